"""The transient peak of Muon's step on one rank: what `Muon._muon_step` allocates, in its order.

`MuonStep.peak` walks the step as `bigdense.muon.optimizer` and `exchange` run it, adding what
each statement allocates and taking away what goes out of scope, and returns the most alive at once
above what the step starts with (weights, gradients, optimizer state). ``L`` is a weight's local
elements (fp32), ``P`` a rank's piece of a matrix, ``s`` the Newton-Schulz dtype's width; a piece is
a view where its rows (columns) are consecutive, else an ``index_select`` copy (`geometry.Piece`):

1. momentum (foreach over the Muon weights): every new buffer and every update (``2 sum L``), and
   ``torch.where``'s choice for one weight. Each matrix's piece of its update: a view, or a copy (a
   block's rows: q, k, v), cast to ``s`` where that is narrower. Then the updates go but for those
   still named: a one-matrix weight's becomes its direction (the result is written into it), and a
   view piece keeps its weight's update until it is sent.
2. the exchange, per round: the gather's send buffer (``torch.cat``) and receive buffer, after which
   the round's pieces go; on the owner the whole matrix, the Newton-Schulz iterates -- ``X``, the
   Gram matrix ``A``, ``b A + c A^2`` and ``X``'s next value beside it (``2 mn + 2 m^2`` for an m x n
   matrix, m <= n) -- and its result (a transposed view for a tall matrix); the scatter's pieces of
   the result (a copy where the piece is not contiguous in it), their concatenation and the receive
   buffer, after which the results go. As each round's scatter completes, this rank's piece of each
   result is delivered (below). The exchange's loop variables make buffers outlive their round:
   the last collective's (``work``) until the next loop over collectives starts, the other scatters'
   until the next round's gathers are issued, the last whole matrix until the next is assembled.
   On one process nothing moves: each matrix (its piece, or the piece placed in a whole matrix where
   its rows or columns are out of order) is orthogonalised and delivered in turn.
3. delivery: a block-stacked weight's direction (``zeros``) when its first block arrives; each
   result cast to fp32 and scaled (a piece-sized temporary) into its direction; when a weight's
   last matrix is in, it is updated in place and its direction goes.

Left out: scalars (the skip flag, the LR products) and index vectors (``torch.arange`` of a row or
column range): a few bytes, or a few hundred per matrix. `tests/test_plan_muon.py` holds the rest
against the live tensor bytes of real steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP32 = 4  # bytes of the weights, gradients and optimizer state Muon reads (the DDP and FSDP engines keep fp32)


def local_shape(entry, layout, rank: int) -> tuple[int, ...]:
    """The shape of the entry's tensor on world rank ``rank`` of ``layout`` (a planner `Layout`):
    its TP shard, or FSDP's chunk of it (``torch.chunk`` along dim 0 over ``dp_shard`` ranks:
    ``ceil(rows / dp_shard)`` rows, the last chunks shorter or empty)."""
    dp, tp = divmod(rank, layout.tp)
    shape = list(entry.local_shape(layout.tp, tp))
    if layout.dp_shard > 1 and shape:
        chunk = math.ceil(shape[0] / layout.dp_shard)
        shard = dp % layout.dp_shard
        shape[0] = max(0, min(chunk, shape[0] - shard * chunk))
    return tuple(shape)


class _Ledger:
    """Bytes alive now, and the most seen."""

    def __init__(self):
        self.now = self.peak = 0

    def hold(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def drop(self, n: int) -> None:
        self.now -= n

    def touch(self, n: int) -> None:
        """A temporary of ``n`` bytes beside what is held (gone before the next statement)."""
        self.peak = max(self.peak, self.now + n)


def _consecutive(ids: torch.Tensor) -> bool:
    """Whether `geometry.Piece` takes these indices as a slice (a view) rather than a gather."""
    return len(ids) == 0 or bool(torch.equal(ids, torch.arange(int(ids[0]), int(ids[0]) + len(ids))))


@dataclass(frozen=True)
class _Cut:
    """Rows and columns a `Piece` selects, from its local tensor or from the whole matrix: how many,
    and whether consecutive (a slice)."""

    rows: int
    cols: int
    row_slice: bool
    col_slice: bool

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def select(self, shape, contiguous: bool, width: int) -> tuple[int, int, bool]:
        """``Piece._select`` from a tensor of ``shape``: ``(peak, kept, contiguous)`` -- the most it
        allocates at once, the bytes of its result (0: a view) and whether that is contiguous."""
        kept = peak = 0
        if not self.row_slice:  # (a row slice keeps the tensor's layout)
            kept = peak = self.rows * shape[1] * width
            contiguous = True
        if self.col_slice:
            contiguous = contiguous and (self.cols == shape[1] or self.rows <= 1)
        else:
            peak = max(peak, kept + self.numel * width)
            kept, contiguous = self.numel * width, True
        return peak, kept, contiguous


class _Walk:
    """One rank's step in progress: each matrix's piece (bytes of its own, 0 for a view of its
    weight's update, and whether contiguous), and who still names each weight's update."""

    def __init__(self, ledger: _Ledger, numels, weight_of, counts):
        self.ledger, self.numels, self.weight_of, self.counts = ledger, numels, weight_of, counts
        self.pieces: list = []
        self.names = [0] * len(numels)  # views of each update still alive (a one-matrix weight's direction one)
        self.left = list(counts)  # matrices of each weight not yet delivered

    def name(self, w: int) -> None:
        self.names[w] += 1

    def unname(self, w: int) -> None:
        self.names[w] -= 1
        if self.names[w] == 0:
            self.ledger.drop(self.numels[w])

    def release(self, m: int) -> None:
        """Matrix ``m``'s piece goes (its bytes, or its name on its weight's update)."""
        kept, _ = self.pieces[m]
        if kept:
            self.ledger.drop(kept)
        else:
            self.unname(self.weight_of[m])


class MuonStep:
    """The step of `Muon` over ``weights`` (as `muon.muon_weights` lists them) moved by
    ``exchange`` (the optimizer's `Exchange` over their matrices) at ``layout``, the Newton-Schulz
    dtype ``width`` bytes wide. What every rank's walk reads of the geometry is worked out once."""

    def __init__(self, weights, exchange, layout, width: int, nesterov: bool = True):
        self.weights, self.exchange, self.layout, self.width, self.nesterov = weights, exchange, layout, width, nesterov
        self.owners = exchange.assignment.owners
        self.sources = [set(m.sources(owner)) for m, owner in zip(exchange.matrices, self.owners)]
        self.weight_of = [w for w, (_, ms) in enumerate(weights) for _ in ms]
        self._cuts: dict = {}

    def _cut(self, m, rank: int, local: bool) -> _Cut:
        """Matrix ``m``'s piece on ``rank``, from the rank's local tensor or from the whole matrix."""
        piece = m.piece(rank)
        key = (id(piece), local)
        if key not in self._cuts:  # (pieces are shared by the ranks that hold the same one)
            rows, cols = (piece.local_rows, piece.local_cols) if local else (piece.rows, piece.cols)
            self._cuts[key] = _Cut(len(rows), len(cols), _consecutive(rows), _consecutive(cols))
        return self._cuts[key]

    def peak(self, rank: int) -> int:
        """The transient peak of the step on ``rank`` (bytes above the state it starts with)."""
        ledger = _Ledger()
        numels = [math.prod(local_shape(entry, self.layout, rank)) * FP32 for entry, _ in self.weights]
        walk = _Walk(ledger, numels, self.weight_of, [len(ms) for _, ms in self.weights])
        self._momentum_and_pieces(walk, rank)
        if self.exchange.layout.world == 1:
            self._alone(walk)
        else:
            self._exchange(walk, rank)
        return ledger.peak

    # ---- 1. momentum and pieces ----
    def _momentum_and_pieces(self, walk: _Walk, rank: int) -> None:
        """Momentum, and each matrix's piece of its update (`_Walk.pieces`)."""
        ledger, numels, width = walk.ledger, walk.numels, self.width
        both = sum(numels) if self.nesterov else 0
        ledger.hold(sum(numels))  # the new buffers
        ledger.hold(both)  # the updates (without Nesterov: the new buffers)
        ledger.touch(max(numels, default=0))  # torch.where, one weight at a time
        ledger.drop(both)
        for w, (entry, matrices) in enumerate(self.weights):
            shape = local_shape(entry, self.layout, rank)
            for m in matrices:
                cut = self._cut(m, rank, local=True)
                peak, kept, contiguous = cut.select(shape, True, FP32)
                ledger.touch(peak)
                if width != FP32:  # .to(): a copy in the narrower dtype (a strided view's comes out contiguous)
                    ledger.touch(kept + cut.numel * width)
                    kept, contiguous = cut.numel * width, True
                ledger.hold(kept)
                walk.pieces.append((kept, contiguous))
                if not kept:
                    walk.name(w)
            if len(matrices) == 1:  # the update is the weight's direction
                walk.name(w)
        for w, numel in enumerate(numels):  # the list of updates goes: those no piece or direction names
            if walk.names[w] == 0:
                ledger.drop(numel)

    # ---- 2. the exchange ----
    def _orthogonalize(self, ledger: _Ledger, shape) -> None:
        """`newton_schulz.orthogonalize` of a matrix already held: its iterates, and the result held."""
        rows, cols = shape
        small = min(rows, cols)
        ledger.touch((2 * rows * cols + 2 * small * small) * self.width)  # X, A, b A + c A^2, X's next value
        ledger.hold(rows * cols * self.width)

    def _alone(self, walk: _Walk) -> None:
        """One process (`Exchange.run`, `Exchange._alone`): each matrix orthogonalised and delivered
        in turn; the loop's ``values`` names the last piece until the next is taken."""
        ledger, size = walk.ledger, self.width
        for index, matrix in enumerate(self.exchange.matrices):
            if index:
                walk.release(index - 1)
            cut, (rows, cols) = self._cut(matrix, 0, local=False), matrix.shape
            piece = matrix.piece(0)
            in_order = cut.row_slice and cut.col_slice and (cut.rows, cut.cols) == (rows, cols) and (
                cut.numel == 0 or (int(piece.rows[0]), int(piece.cols[0])) == (0, 0))
            whole = 0 if in_order else rows * cols * size
            ledger.hold(whole)
            self._orthogonalize(ledger, matrix.shape)
            result = rows * cols * size
            if not in_order:  # this rank's piece of the result (a view, or a copy: then the result goes)
                peak, kept, _ = cut.select((rows, cols), rows <= cols, size)
                ledger.touch(peak)
                ledger.hold(kept)
                ledger.drop(whole + (result if kept else 0))
                result = kept or result
            self._deliver(walk, 0, index)
            ledger.drop(result)

    def _gather(self, walk: _Walk, batch, rank: int) -> int:
        """`Exchange._start_gather`: the send and receive buffers held, the batch's pieces gone;
        returns the buffers' bytes."""
        ledger, send, recv, copies, early = walk.ledger, 0, 0, 0, []
        for m in batch:
            matrix = self.exchange.matrices[m]
            source = rank in self.sources[m]
            if source:
                numel = self._cut(matrix, rank, local=False).numel * self.width
                send += numel
                copies += 0 if walk.pieces[m][1] else numel  # reshape(-1) of a strided view
            if not source or not walk.pieces[m][1]:
                early.append(m)  # not named by a chunk: goes with ``pieces[m] = None``
            if self.owners[m] == rank:
                recv += sum(self._cut(matrix, src, local=False).numel for src in self.sources[m]) * self.width
        ledger.hold(copies)
        ledger.hold(send)  # torch.cat
        for m in early:
            walk.release(m)
        ledger.hold(recv)  # allocated while the chunks are alive
        ledger.drop(copies)
        for m in batch:
            if m not in early:
                walk.release(m)
        return send + recv

    def _scatter(self, ledger: _Ledger, batch, rank: int) -> int:
        """`Exchange._start_scatter`: the send and receive buffers held; returns their bytes."""
        chunks = send = 0
        for dst in range(self.exchange.layout.world):
            for m in [m for m in batch if self.owners[m] == rank]:
                matrix = self.exchange.matrices[m]
                cut, (rows, cols) = self._cut(matrix, dst, local=False), matrix.shape
                # The result is X, or for a tall matrix X's transpose (a view, not contiguous).
                peak, chunk, contiguous = cut.select(matrix.shape, rows <= cols, self.width)
                ledger.touch(peak)
                if not contiguous:  # reshape(-1) copies a strided view
                    ledger.touch(chunk + cut.numel * self.width)
                    chunk = cut.numel * self.width
                ledger.hold(chunk)
                chunks, send = chunks + chunk, send + cut.numel * self.width
        ledger.hold(send)  # torch.cat
        recv = sum(self._cut(self.exchange.matrices[m], rank, local=False).numel for m in batch) * self.width
        ledger.hold(recv)  # allocated while the chunks are alive
        ledger.drop(chunks)
        return send + recv

    def _deliver(self, walk: _Walk, rank: int, m: int) -> None:
        """``deliver``: matrix ``m``'s result into its weight's direction; the weight stepped (in
        place) and its direction gone when it was the last."""
        ledger, w = walk.ledger, self.weight_of[m]
        multi = walk.counts[w] > 1
        if multi and walk.left[w] == walk.counts[w]:
            ledger.hold(walk.numels[w])  # the direction, zeros
        piece = self._cut(self.exchange.matrices[m], rank, local=False).numel * FP32
        ledger.touch(piece * (1 if self.width == FP32 else 2))  # values.to(fp32) * ratio
        walk.left[w] -= 1
        if walk.left[w] == 0:  # `_apply` works in place; the direction goes
            if multi:
                ledger.drop(walk.numels[w])
            else:
                walk.unname(w)

    def _exchange(self, walk: _Walk, rank: int) -> None:
        """`Exchange.run` over more than one process."""
        ledger, owners, world = walk.ledger, self.owners, self.exchange.layout.world
        scatters, whole = [], 0
        for batches in self.exchange.rounds:
            gathers = [self._gather(walk, batch, rank) for batch in batches]
            ledger.drop(sum(scatters[:-1]))  # `pending` rebound: the last round's scatters but the one `work` names
            ledger.drop(sum(scatters[-1:]))  # `work` rebound
            results = 0
            for batch in batches:
                for m in [m for m in batch if owners[m] == rank]:
                    rows, cols = self.exchange.matrices[m].shape
                    ledger.hold(rows * cols * self.width)  # assembled beside the last whole, then `whole` rebound
                    ledger.drop(whole)
                    whole = rows * cols * self.width
                    self._orthogonalize(ledger, (rows, cols))
                    results += rows * cols * self.width
            scatters = [self._scatter(ledger, batch, rank) for batch in batches]
            ledger.drop(sum(gathers[:-1]))  # `pending` rebound: the gathers but the one `work` names
            ledger.drop(results)  # del results
            ledger.drop(gathers[-1])  # `work` rebound
            for batch in batches:
                for src in range(world):
                    for m in batch:
                        if owners[m] == src:
                            self._deliver(walk, rank, m)
