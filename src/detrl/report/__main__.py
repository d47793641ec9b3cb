from detrl.report import main

main()
