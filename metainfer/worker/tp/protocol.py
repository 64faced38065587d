"""What rank 0 and the TP workers say to each other: pickled messages over one duplex pipe per
worker, the build-time agreements, and the per-step delta.

Messages
  start  worker -> ("hello", pid), then after building ("ready", num_blocks), or ("error", traceback) /
         ("peer-failure",).
  step   rank 0 -> ("step", StepDelta): only what changed since the last step (below). No reply: the
         collectives inside the forward are the synchronisation.
  close  rank 0 -> ("close",).

The step delta. Rank 0's `StepEncoder` remembers, per sequence it has sent, which block-table object
it saw and how many of its blocks the worker holds. A step then carries: the tables of sequences new
to the workers (or re-admitted after preemption: the block manager gives a preempted sequence a new
table object), the blocks appended to known tables, the ids of sequences that are gone (finished,
aborted), and per scheduled row only (seq id, first position, scheduled tokens, will_sample). The
worker's `StepMirror` applies it to its copies and hands the runner the same batch rank 0 runs.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metainfer.engine.scheduler import PromptLogprobRows, ScheduledBatch


def send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def try_send(conn, message) -> None:
    try:
        send(conn, message)
    except (OSError, ValueError):
        pass


class PeerFailure(RuntimeError):
    """Another rank reported a failure while the model was being built."""


class BuildSync:
    """The agreements every rank makes while building (all-reduce MIN of [ok, value])."""

    def __init__(self, device: torch.device):
        self.device, self.failed = device, False

    def agree(self, value: int, ok: bool = True) -> int:
        flags = torch.tensor([int(ok), value], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        ok_all, agreed = flags.tolist()
        if not ok_all:
            self.failed = True
            raise PeerFailure("a tensor-parallel rank failed while building the model")
        return agreed

    def report_failure(self) -> None:
        """Called by a rank that raised: join the agreement the others are heading to."""
        if not self.failed:
            try:
                self.agree(0, ok=False)
            except PeerFailure:
                pass


@dataclass
class StepDelta:
    is_prefill: bool
    new: list[tuple[int, list[int]]]  # (seq id, whole block table)
    appended: list[tuple[int, list[int]]]  # (seq id, blocks added at the end of its table)
    gone: list[int]  # seq ids the workers can forget
    rows: list[tuple[int, int, list[int], bool]]  # (seq id, first position, scheduled tokens, will_sample)
    num_decode_rows: int = 0  # a mixed step's leading decode rows (the workers split the attention alike)
    prompt_rows: list[int] | None = None  # rows rank 0 scores prompt logprobs on (the LM head gather is collective)


class StepEncoder:
    """Rank 0's side: a ScheduledBatch -> the StepDelta since the previous one."""

    def __init__(self):
        self._sent: dict[int, tuple[object, list[int], int]] = {}  # seq id -> (seq, table object, blocks sent)

    def encode(self, batch: ScheduledBatch) -> StepDelta:
        new, appended, rows = [], [], []
        scheduled = set()
        for seq in batch.seqs:
            sid, table = seq.seq_id, seq.block_table
            scheduled.add(sid)
            known = self._sent.get(sid)
            if known is None or known[1] is not table:  # first time, or re-admitted with a new table
                new.append((sid, list(table)))
            elif len(table) > known[2]:
                appended.append((sid, table[known[2]:]))
            self._sent[sid] = (seq, table, len(table))
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            rows.append((sid, start, seq.token_ids[start:start + n], seq.will_sample))
        gone = [sid for sid, (seq, _, _) in self._sent.items() if sid not in scheduled and seq.is_finished]
        for sid in gone:
            del self._sent[sid]
        scored = batch.prompt_logprobs
        return StepDelta(batch.is_prefill, new, appended, gone, rows, batch.num_decode_rows,
                         scored.rows if scored is not None else None)


class _TokenWindow:
    """The tokens a step reads from one sequence: token_ids[start:start+n], indexed globally."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, key: slice) -> list[int]:
        if not isinstance(key, slice) or key.step is not None or (key.start or 0) < self.start:
            raise IndexError(f"a TP batch view holds tokens from position {self.start} on, not {key!r}")
        return self.tokens[key.start - self.start:key.stop - self.start]


class MirroredSeq:
    """What the runner reads of a Sequence (worker/step_inputs.py: pack_step), kept by a worker."""

    __slots__ = ("seq_id", "block_table", "num_computed_tokens", "num_scheduled_tokens", "token_ids",
                 "will_sample", "sample_row")

    def __init__(self, seq_id: int, block_table: list[int]):
        self.seq_id, self.block_table = seq_id, block_table
        self.num_computed_tokens = self.num_scheduled_tokens = 0
        self.token_ids, self.will_sample, self.sample_row = _TokenWindow(0, []), False, -1


class StepMirror:
    """A worker's side: applies each StepDelta to its copies and returns the batch rank 0 runs."""

    def __init__(self):
        self.seqs: dict[int, MirroredSeq] = {}

    def apply(self, delta: StepDelta) -> ScheduledBatch:
        for sid in delta.gone:
            self.seqs.pop(sid, None)
        for sid, table in delta.new:
            self.seqs[sid] = MirroredSeq(sid, table)
        for sid, blocks in delta.appended:
            self.seqs[sid].block_table.extend(blocks)
        batch = []
        for sid, start, tokens, will_sample in delta.rows:
            seq = self.seqs[sid]
            seq.num_computed_tokens, seq.num_scheduled_tokens = start, len(tokens)
            seq.token_ids, seq.will_sample = _TokenWindow(start, tokens), will_sample
            batch.append(seq)
        scored = PromptLogprobRows(delta.prompt_rows, [], [], 0) if delta.prompt_rows else None
        return ScheduledBatch(batch, delta.is_prefill, delta.num_decode_rows, scored)


class RankLink:
    """How a ModelRunner reaches the other ranks: the single-rank link (this class) does nothing; a worker's
    link agrees through a BuildSync; rank 0's TPDriver also publishes each step and reports failures."""

    def __init__(self, sync: BuildSync | None = None):
        self.sync = sync

    def agree(self, value: int) -> int:
        return value if self.sync is None else self.sync.agree(value)

    def publish(self, batch: ScheduledBatch) -> None:
        return None

    def step_failed(self, exc: BaseException) -> None:
        """Called with a step's exception before it propagates (rank 0 adds the workers' tracebacks)."""
        return None


LOCAL = RankLink()
