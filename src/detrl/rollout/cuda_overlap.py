"""The engine core with one decode step in flight: the host schedules step t + 1 while the device runs step t.

Without it every decode step ends in a host sync (the sampled tokens are read to append them and to see which
sequences stopped), so the device idles while the host launches the next step's graph (0.7-1.5 ms of host time
for a 28-layer graph on an H100) and does the step's bookkeeping. SGLang's overlap scheduler runs the host one
step ahead instead; so does this core: step t + 1 is launched with step t's tokens as its inputs, read on the
device (`DecodeGraphs` copies them into its static inputs), and only then are step t's tokens copied back, read,
appended and checked for stop tokens. A sequence that stopped at step t has run step t + 1 too (wasted work,
its result dropped); a sequence that reaches its length limit at step t is known in advance and does not.

A step is pipelined only when it is a plain continuation: every running sequence is in flight, none waits for
admission, the pool has the blocks the step needs (no preemption) and the draw needs no host: every row seeded
with one temperature and top_p (the replayed step draws, `_seeded_draw`) or every row on the stream with one
(the core draws on the device from the step's logits). Otherwise the flight lands first and the step runs as
`EngineCore.step` does. Under `on` a row's bits do not depend on the rows beside it, so the tokens and logprobs
are the plain core's, bit for bit (a cut by `stop_when` too: the step in flight is dropped); under `off` a stopped
row's wasted step also takes stream draws, as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detrl.rollout.scheduler import EngineCore, Finished, Sequence, _seeded_draw


@dataclass(eq=False)
class Flight:
    """A decode step the host has not read: its rows, its tokens [B] on the device (the next step's inputs),
    and its tokens, logprobs (and expert ids) on their way to the host, ready at `done`."""

    rows: list[Sequence]
    tokens: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    done: torch.cuda.Event | None


def _stream_draw(rows: list[Sequence]) -> tuple[float, float] | None:
    """(temperature, top_p) when every row draws from the stream with one temperature and top_p."""
    params = {(s.params.temperature, s.params.top_p) for s in rows}
    if len(params) != 1 or any(s.request.seed is not None for s in rows):
        return None
    return params.pop()


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor t into pinned host memory, queued (read it after the copy's event)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class OverlapCore(EngineCore):
    """`EngineCore` whose decode steps (through its `decode` runner) run one step ahead of the host."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flight: Flight | None = None
        self.pipelined = 0  # decode steps launched before the previous one was read

    def idle(self) -> bool:
        return self.flight is None and super().idle()

    @torch.no_grad()
    def step(self) -> list[Finished]:
        flight = self.flight
        if flight is None:
            return super().step()
        rows = self._continuation(flight)
        if rows is None:  # not a plain continuation: read the flight, then a step as the plain core's
            self.flight = None
            return self._land(flight) + super().step()
        self.flight = self._launch(rows, flight)
        self.steps += 1
        self.pipelined += 1
        return self._land(flight)

    def abort(self) -> list[Finished]:
        """The plain core's cut: the step in flight is dropped unread (the plain core would not have run it yet when
        the caller saw the results that made it cut), every row out with the tokens read so far."""
        self.flight = None  # its writes are queued before anything that reuses the rows' blocks
        return super().abort()

    def _decoded(self, batch: list[Sequence], logits, route, drawn) -> list[Finished]:
        """The plain step's replayed decode: left in flight where its draw needs no host."""
        flight = self._flight(batch, logits, route, drawn)
        if flight is None:
            return super()._decoded(batch, logits, route, drawn)
        self.flight = flight
        return []

    def _continuation(self, flight: Flight) -> list[Sequence] | None:
        """The rows of the next decode step if it can run before the flight is read (see the module), else None."""
        live = {id(s) for s in self.running}
        inflight = [s for s in flight.rows if id(s) in live]
        if len(inflight) != len(self.running) or (self.waiting and len(self.running) < self.max_running):
            return None
        # the flight's token is each row's len(tokens) - context + 1-th: those at their limit leave with it
        rows = [s for s in inflight if len(s.tokens) + 1 - s.context < s.limit]
        fresh = sum(map(self._needs_block, rows))
        if not rows or fresh > len(self.manager.free):
            return None
        if _seeded_draw(rows) is None and _stream_draw(rows) is None:
            return None
        return rows

    def _launch(self, rows: list[Sequence], flight: Flight) -> Flight:
        """The next decode step over `rows`, its input tokens the flight's, on the device."""
        for s in rows:
            if self._needs_block(s):
                s.blocks.table.append(self.manager.allocate())
        positions, _, table, write, read = self._inputs(rows, [1] * len(rows))
        tokens = flight.tokens
        if len(rows) != len(flight.rows) or any(a is not b for a, b in zip(rows, flight.rows)):
            at = {id(s): i for i, s in enumerate(flight.rows)}
            index = torch.tensor([at[id(s)] for s in rows])  # to the device without a sync (pinned)
            cuda = tokens.device.type == "cuda"
            tokens = tokens[(index.pin_memory() if cuda else index).to(tokens.device, non_blocking=True)]
        logits, route, drawn = self.decode(
            self.pool, tokens[:, None], positions, write, table, read, _seeded_draw(rows)
        )
        for s in rows:
            s.computed += 1
        self.computed_tokens += len(rows)
        out = self._flight(rows, logits, route, drawn)
        assert out is not None, "a continuation's draw needs no host"
        return out

    def _needs_block(self, s: Sequence) -> bool:
        """Whether position `computed`, where the flight's token is written, lies past the row's blocks."""
        return len(s.blocks.table) * self.block_size <= s.computed

    def _flight(self, rows: list[Sequence], logits, route, drawn) -> Flight | None:
        """The step's tokens drawn (in the step, or here from its logits on the stream) and sent to the host
        without waiting; None where the draw needs the host (mixed seeds or sampling params)."""
        if drawn is None:
            params = _stream_draw(rows)
            if params is None:
                return None
            drawn = self._draw(rows, logits, *params)
        if self.device.type != "cuda":
            return Flight(rows, drawn[0], (*drawn, route), None)
        host = tuple(None if t is None else _pinned(t) for t in (*drawn, route))
        done = torch.cuda.Event()
        done.record()
        return Flight(rows, drawn[0], host, done)

    def _land(self, flight: Flight) -> list[Finished]:
        """The flight read: its tokens appended to the rows still running, their full blocks published, the rows
        that finish out."""
        if flight.done is not None:
            flight.done.synchronize()
        live = {id(s) for s in self.running}
        keep = [i for i, s in enumerate(flight.rows) if id(s) in live]  # a row that stopped before is out
        rows = [flight.rows[i] for i in keep]
        tokens, logprobs, route = flight.host
        leaving = self._take(rows, tokens[keep], logprobs[keep], None if route is None else route[keep])
        for s in rows:
            self._publish(s)
        return self._leave(leaving)
