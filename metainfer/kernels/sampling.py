"""Greedy / temperature sampling in one pass over the logits (Gumbel-max).

Contract (docs/CONTRACTS.md): `gumbel_sample(logits[B, >=V], temperatures fp32[B], vocab_size V,
seed) -> token ids int64[B]`: a row with temperature 0 takes argmax(logits[:V]) (the first index of
the maximum, as torch.argmax; NaN counts as +inf; a row of -inf gives 0); any other row draws from
softmax(logits[:V] / T) as argmax(logits / T - log(E)), E = -log(1 - U) i.i.d. Exp(1) noise from
uniforms U in [0, 1) (Philox): the exponential race (Gumbel-max), an exact draw up to the noise's fp32
resolution (E is taken by its series below U = 1e-3, so the winning tail keeps U's 2^-31 steps; E is
floored at 2^-32). The uniforms come four at a time from one Philox evaluation (`tl.rand4x(seed,
counter)`): column c of a row takes output (c mod BLOCK) // (BLOCK / 4) of the counter
(row * C + c - c mod BLOCK) / 4 + c mod (BLOCK / 4), C the row's columns rounded up to the splits' chunks, so
every column of the batch has its own uniform. The caller changes `seed` every step.
`noise` (fp32 [B, V] uniforms) replaces the generator: the reference and the tests use it to check
the kernel element for element.

Why: the torch sampler's temperature path reads and writes [B, V] fp32 about ten times (cast,
argmax, divide, softmax, exponential noise, divide, argmax): ~0.4 ms a 256-sequence step on the
H200 against ~0.05 ms for one read of the bf16 logits. Philox is the kernel's own cost at temperature > 0 (20
32-bit high multiplies an evaluation; `tl.rand` keeps one of its four outputs): run 17 read 0.285 ms at 256 rows
against 0.131 greedy, hence four uniforms an evaluation. Programs split the vocabulary so that even
a batch of 1 fills the GPU; the last program of a row to finish reduces the partial maxima (an
arrival counter, as the split decode attention).
"""

from __future__ import annotations

import torch

from ._triton import cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton

_BLOCK = 1024
_THIRD = 0.33333334  # fp32 1/3
_E_FLOOR = 2.3283064e-10  # 2^-32: U = 0 draws a Gumbel of 22.2, not +inf
# Programs to aim for (a few per SM on a 132-SM GPU): the vocabulary is split until the grid reaches it.
_TARGET_PROGRAMS = 1024


def _exp_noise_ref(u: torch.Tensor) -> torch.Tensor:
    """E = -log(1 - u) in the kernel's fp32 operation order (a series below 1e-3, floored at 2^-32)."""
    series = u + u * u * 0.5 + u * u * u * _THIRD
    return torch.where(u < 1e-3, series, -torch.log(1.0 - u)).clamp_min(_E_FLOOR)


def gumbel_sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, vocab_size: int,
                      noise: torch.Tensor) -> torch.Tensor:
    """The kernel's formula with given uniforms: argmax of where(T == 0, x, x / T - log(E(u)))."""
    x = logits[:, :vocab_size].float()
    x = torch.where(torch.isnan(x), float("inf"), x)
    t = temperatures.float().unsqueeze(1)
    keys = torch.where(t == 0, x, x * (1.0 / torch.where(t == 0, 1.0, t))
                       - torch.log(_exp_noise_ref(noise[:, :vocab_size].float())))
    return keys.argmax(dim=-1)


def sample_splits(batch: int, vocab_size: int) -> int:
    """Vocabulary splits per row: enough programs to fill the GPU, at least one block a split."""
    return max(1, min(cdiv(_TARGET_PROGRAMS, max(1, batch)), cdiv(vocab_size, _BLOCK)))


@triton.jit
def _exp_noise(u):
    return tl.maximum(tl.where(u < 1e-3, u + u * u * 0.5 + u * u * u * 0.33333334, -tl.log(1.0 - u)),
                      2.3283064e-10)


@triton.jit
def _best(keys, idx):
    """(max key, smallest index holding it; 0 if none does, e.g. a row of -inf)."""
    top = tl.max(keys, axis=0)
    top_idx = tl.min(tl.where(keys == top, idx, 2147483647), axis=0)
    return top, tl.where(top_idx == 2147483647, 0, top_idx)


@triton.jit
def _fold(best_key, best_idx, logits_ptr, noise_ptr, row, cols, stop, stride_l, stride_n, inv_t, greedy, u,
          HAS_NOISE: tl.constexpr):
    """One sub-tile of columns folded into the lanes' running best (key, index)."""
    mask = cols < stop
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax
    if greedy:  # uniform over the program: greedy rows draw no noise
        key = x
    else:
        if HAS_NOISE:
            u = tl.load(noise_ptr + row.to(tl.int64) * stride_n + cols, mask=mask, other=0.5)
        key = x * inv_t - tl.log(_exp_noise(u))
    key = tl.where(mask, key, float("-inf"))
    better = key > best_key  # strict: a lane keeps its first (smallest) index on ties
    return tl.where(better, key, best_key), tl.where(better, cols, best_idx)


@triton.jit(do_not_specialize=["stride_n", "seed", "num_splits"])
def _gumbel_sample_kernel(logits_ptr, temps_ptr, noise_ptr, out_ptr, part_key_ptr, part_idx_ptr, counters_ptr,
                          V, stride_l, stride_n, seed, chunk, num_splits,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                          HAS_NOISE: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, split) scans columns [split * chunk, +chunk) for its best key, a tile of BLOCK columns as
    four sub-tiles that share one Philox evaluation; unsplit it writes the token, else its (key, index)
    partial, and the row's last arrival picks the best. Triton specialises V, the row stride and chunk (a
    multiple of BLOCK) on divisibility by 16, so a thread's contiguous logits load together (a greedy row's 8
    as one 16-byte access, a temperature sub-tile's 2 as one 4-byte access; unspecialised, every logit was
    its own 2-byte load: sm_90 SASS LDG.E.U16); the seed, the split count and the noise stride are not: one
    compiled variant per (SPLIT, BLOCK_S, the stride's class), whatever the batch."""
    pdl_enter(USE_PDL)
    QUARTER: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temps_ptr + row)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    begin = split * chunk
    stop = tl.minimum(begin + chunk, V)
    if greedy:  # uniform over the program: no noise; two BLOCK-wide loads in flight a step
        wide_key = tl.full([BLOCK], float("-inf"), tl.float32)
        wide_idx = tl.full([BLOCK], 2147483647, tl.int32)
        for c0 in range(begin, stop, 2 * BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            wide_key, wide_idx = _fold(wide_key, wide_idx, logits_ptr, noise_ptr, row, cols, stop, stride_l,
                                       stride_n, inv_t, greedy, wide_key, HAS_NOISE)
            wide_key, wide_idx = _fold(wide_key, wide_idx, logits_ptr, noise_ptr, row, cols + BLOCK, stop, stride_l,
                                       stride_n, inv_t, greedy, wide_key, HAS_NOISE)
        top, top_idx = _best(wide_key, wide_idx)
    else:  # four sub-tiles a tile, sharing one Philox evaluation
        lanes = tl.arange(0, QUARTER)
        row_counter = row * (chunk * num_splits // 4)  # chunk is a multiple of BLOCK: counters never overlap
        best_key = tl.full([QUARTER], float("-inf"), tl.float32)
        best_idx = tl.full([QUARTER], 2147483647, tl.int32)
        for c0 in range(begin, stop, BLOCK):
            if HAS_NOISE:
                u0 = tl.zeros([QUARTER], tl.float32)  # unused: _fold loads the given noise
                u1, u2, u3 = u0, u0, u0
            else:
                u0, u1, u2, u3 = tl.rand4x(seed, row_counter + c0 // 4 + lanes)
            cols = c0 + lanes
            best_key, best_idx = _fold(best_key, best_idx, logits_ptr, noise_ptr, row, cols, stop, stride_l,
                                       stride_n, inv_t, greedy, u0, HAS_NOISE)
            best_key, best_idx = _fold(best_key, best_idx, logits_ptr, noise_ptr, row, cols + QUARTER, stop,
                                       stride_l, stride_n, inv_t, greedy, u1, HAS_NOISE)
            best_key, best_idx = _fold(best_key, best_idx, logits_ptr, noise_ptr, row, cols + 2 * QUARTER, stop,
                                       stride_l, stride_n, inv_t, greedy, u2, HAS_NOISE)
            best_key, best_idx = _fold(best_key, best_idx, logits_ptr, noise_ptr, row, cols + 3 * QUARTER, stop,
                                       stride_l, stride_n, inv_t, greedy, u3, HAS_NOISE)
        top, top_idx = _best(best_key, best_idx)
    if not SPLIT:
        tl.store(out_ptr + row, top_idx.to(tl.int64))
    else:
        slot = row * num_splits + split
        tl.store(part_key_ptr + slot, top)
        tl.store(part_idx_ptr + slot, top_idx)
        tl.debug_barrier()  # the partial is stored before the counting thread releases it
        arrived = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the row's last split: reduce the partials
            tl.debug_barrier()
            tl.atomic_xchg(counters_ptr + row, 0, sem="relaxed", scope="gpu")
            s = tl.arange(0, BLOCK_S)
            s_mask = s < num_splits
            keys = tl.load(part_key_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"),
                           cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + row * num_splits + s, mask=s_mask, other=2147483647, cache_modifier=".cg")
            _, token = _best(keys, idxs)
            tl.store(out_ptr + row, token.to(tl.int64))


class GumbelSampler:
    """`gumbel_sample` with its scratch allocated once for up to `max_batch` rows (partials and
    arrival counters; the counters are left zeroed by every launch). On CUDA every compiled variant
    is built here (`warmup_dtype`: the logits' dtype), so no serving step compiles."""

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device | str, pdl: bool = False,
                 warmup_dtype: torch.dtype | None = None):
        require_triton()
        device = torch.device(device)
        numel = max(b * sample_splits(b, vocab_size) for b in range(1, max_batch + 1))
        self.max_batch, self.vocab_size, self.pdl = max_batch, vocab_size, pdl
        self.part_keys = torch.empty(numel, dtype=torch.float32, device=device)
        self.part_idx = torch.empty(numel, dtype=torch.int32, device=device)
        self.counters = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.zero_temperatures = torch.zeros(max_batch, dtype=torch.float32, device=device)
        if device.type == "cuda" and warmup_dtype is not None:
            self._warm_up(warmup_dtype)

    def _launch_shape(self, batch: int) -> tuple[int, int, int]:
        """(splits, chunk, BLOCK_S): every split owns at least one column."""
        splits = sample_splits(batch, self.vocab_size)
        chunk = cdiv(cdiv(self.vocab_size, splits), _BLOCK) * _BLOCK
        splits = cdiv(self.vocab_size, chunk)
        return splits, chunk, max(16, next_pow2(splits))

    def _warm_up(self, dtype: torch.dtype) -> None:
        first_of_variant = {}
        for b in range(1, self.max_batch + 1):
            splits, _, block_s = self._launch_shape(b)
            first_of_variant.setdefault((splits > 1, block_s), b)
        device = self.counters.device
        aligned_width = cdiv(self.vocab_size, 16) * 16
        for b in first_of_variant.values():
            for width in (aligned_width, aligned_width + 1):  # both row-stride classes (multiple of 16 or not)
                logits = torch.zeros(b, width, dtype=dtype, device=device)
                self(logits, self.zero_temperatures[:b], seed=2)
        torch.cuda.synchronize(device)

    def __call__(self, logits: torch.Tensor, temperatures: torch.Tensor, seed: int,
                 noise: torch.Tensor | None = None) -> torch.Tensor:
        batch = logits.shape[0]
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size or logits.stride(1) != 1:
            raise ValueError(f"logits must be [B, >= {self.vocab_size}] with a unit last stride, "
                             f"got {tuple(logits.shape)}")
        if batch > self.max_batch or temperatures.shape != (batch,) or temperatures.dtype != torch.float32:
            raise ValueError(f"temperatures must be fp32 [{batch}] and the batch <= {self.max_batch}, got "
                             f"{tuple(temperatures.shape)} {temperatures.dtype}")
        if noise is not None and (noise.shape[0] != batch or noise.shape[1] < self.vocab_size
                                  or noise.stride(1) != 1 or noise.dtype != torch.float32):
            raise ValueError(f"noise must be fp32 [{batch}, >= {self.vocab_size}], got {tuple(noise.shape)}")
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
        if batch == 0:
            return out
        splits, chunk, block_s = self._launch_shape(batch)
        _gumbel_sample_kernel[(batch, splits)](
            logits, temperatures, noise if noise is not None else logits, out, self.part_keys, self.part_idx,
            self.counters, self.vocab_size, logits.stride(0), noise.stride(0) if noise is not None else 0,
            int(seed) & 0x7FFFFFFF, chunk, splits,
            SPLIT=splits > 1, BLOCK=_BLOCK, BLOCK_S=block_s, HAS_NOISE=noise is not None,
            num_warps=4, **pdl_args(self.pdl),
        )
        return out


__all__ = ["GumbelSampler", "gumbel_sample_ref", "sample_splits"]
