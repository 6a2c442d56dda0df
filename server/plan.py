"""The execution plan: every decision about how batches run, in one table a reader can check.

jax-free (``cpu_devices`` reads it before jax starts). Given the model, the host and the limits
it decides, once, at the engine's construction (measurements: benchmarks/NOTES.md):

- CPU devices: ``CPU_DATA_PARALLEL`` emulated devices on a single-process CPU host (two programs
  keep two cores busy where one XLA:CPU program does not);
- auto mesh: every device on ``data``; on a single-process CPU host only that many;
- batch buckets: data x 2^k up to ``max_batch_images`` (rounded up to a multiple of data): one
  compiled forward per bucket, padding at most doubles a batch;
- small buckets: on a single-process CPU host also 1, 2, 4 .. below the data axis, run on that
  many of its rows (emulated devices share the cores: one image on one device gets them all);
- rows by work: there too, a bucket runs on as many rows as each get ``CPU_MIN_ROW_FLOPS`` of
  work at its grid (a row's program costs a fixed CPU time whatever its batch);
- midpoint buckets: there too, 3a/2 between buckets a and 2a where a batch of 3a/2 images
  computes fewer rows in it than in 2a on the same data rows (``Plan.work``): padding then
  costs at most a third of a batch, not all of it, where the chunk steps cannot skip it (the
  tiny model's 20-24 images: 0.81x the CPU of bucket 32, ``benchmarks/plan_ab.py``);
- compute dtype ``auto`` (the serving and job default): the checkpoint's or preset's, except
  float32 in place of a bfloat16 default on a CPU without bf16 instructions, where XLA:CPU
  emulates bf16 matmuls and the forward is slower than in float32 (and inexact);
- chunks: on CPU, images per data shard and step such that a step's widest activation stays
  within ``CPU_CHUNK_BYTES`` (XLA:CPU's GEMMs lose a third of their speed at ViT-B batch-32
  shapes); elsewhere whole buckets; ``chunk_images`` overrides (0: never chunk);
- transposed kernels: in bf16 compute on a single-process CPU host with AMX and the model axis
  1, the down projections (``CPU_TRANSPOSED_KERNELS``) stored [out, in] (``vit.kernel``), and
  XLA's loop-invariant code motion off for the forward (``compiler_options``); with them, a
  sequential block's MLP activation and fc2 in slices of the tokens whose fc2 input per device
  is about ``CPU_MLP_SLICE_BYTES`` (``mlp_slices``).

``Plan.table()`` renders the chosen values (the server logs it at start).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vit22b.model.config import ViTConfig

# A step's widest activation (f32, tokens x the MLP hidden, plus q/k/v in a parallel block) is
# kept to about a third of a 32 MB L3: ViT-B/16 runs 4 images per device and step.
CPU_CHUNK_BYTES = 10 << 20
# A data row's program costs a fixed CPU time whatever its batch (XLA:CPU's runtime per
# operation): the 4-block tiny model's batch of 2 took 2.5 ms of CPU on two rows, 1.7 on one.
# Below this much work a row a bucket runs on fewer rows: the tiny model's buckets of 2-8
# images (8.5 MFLOP an image) on one, ViT-Ti/16 (2.5 GFLOP) and larger on every row
# (benchmarks/NOTES.md, "Rows by work").
CPU_MIN_ROW_FLOPS = 50_000_000
# Emulated CPU devices on the data axis of a single-process CPU host, by compute dtype.
CPU_DATA_PARALLEL = {"bfloat16": 2, "float32": 2}
CPU_DEVICES = max(CPU_DATA_PARALLEL.values())  # what the server asks XLA for
# The down projections (the MLP's fc2, the parallel block's fused out-projection) contract
# their long axis. On an AMX host XLA:CPU's bf16 GEMM ran them faster from a kernel stored
# [out, in] (contracted axis last) than [in, out]: ViT-B/16's forward 5% faster, ViT-L/16's
# 10%, vit-22b-base/14's 13%, the tiny model's the same; ViT-B's and ViT-L's features the same
# bits. The up projections (qkv, fc1, the fused in-projection) ran 2% faster to 17% slower that
# way and stay; in f32 it was neither faster nor slower (benchmarks/NOTES.md, "Kernels stored
# transposed"). Measured on Intel AMX hosts alone: elsewhere, and in f32, kernels stay as stored.
CPU_TRANSPOSED_KERNELS = frozenset({"w_fc2", "w_out"})
CPU_TRANSPOSE_FLAG = "amx_bf16"
# XLA's loop-invariant code motion hoists a transposed kernel's transpose out of the chunks'
# loop and materialises it there: a copy of every such kernel per forward, and the GEMMs back
# to [in, out]. Off for these forwards; without transposed kernels it was neither faster nor
# slower for ViT-B/16 (0.998x) or vit-22b-base/14 (1.005x).
NO_LOOP_MOTION = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# With fc2 stored [out, in] (cheap to pack), fc2 and the activation before it ran faster in
# slices of the tokens whose bf16 fc2 input stays within about this much (a core's L2 is 2 MB):
# ViT-B/16's step (788 rows per device x 3072) in 4 slices 5-7% less time, DINOv3-B/16's 7%,
# ViT-L/16's (394 x 4096) in 3 1.5-3%; 2 or 8 slices gained less for ViT-B, and with the
# kernels as stored slices gained nothing (benchmarks/NOTES.md, "MLP slices").
CPU_MLP_SLICE_BYTES = 5 << 18  # 1.25 MiB


# CPU flags (/proc/cpuinfo) of bf16 dot-product instructions: x86's AVX512_BF16 and AMX, Arm's
# FEAT_BF16. Without them XLA:CPU converts bf16 matmul inputs to f32 and back: on a Zen 3 host
# (AVX2 only) the forward ran 34-38% slower in bf16 than in f32 for ViT-B/16, 25-57% for ViT-S
# and ViT-Ti at batches 1-32 (benchmarks/NOTES.md, "A CPU without bf16 instructions").
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
AUTO_DTYPE = "auto"


def cpu_bf16(cpu_flags: frozenset[str] | None) -> bool | None:
    """Whether a CPU with these flags has bf16 instructions (None: the flags are unknown)."""
    return None if cpu_flags is None else bool(cpu_flags & CPU_BF16_FLAGS)


def auto_compute_dtype(default: str, platform: str,
                       cpu_flags: frozenset[str] | None) -> tuple[str, str]:
    """The compute dtype ``auto`` resolves to, and why when it is not ``default`` (else "").

    ``default``: the checkpoint's or preset's; ``cpu_flags``: the host's (None: unknown, and
    the default stands). OpenVINO's CPU plugin treats its bf16 hint the same way."""
    if default != "bfloat16" or platform != "cpu" or cpu_bf16(cpu_flags) is not False:
        return default, ""
    return "float32", ("float32 in place of the model's bfloat16: this CPU has no bf16 "
                       "instructions (avx512_bf16, amx_bf16 or Arm's bf16), where bf16 runs "
                       "slower than float32; --compute-dtype bfloat16 forces it")


def batch_buckets(max_batch_images: int, data_size: int) -> tuple[int, ...]:
    """data_size * 2^k below the maximum, then the maximum rounded up to a multiple of data."""
    if max_batch_images < 1:
        raise ValueError(f"max_batch_images must be positive, got {max_batch_images}")
    top = -(-max_batch_images // data_size) * data_size
    buckets, size = [], data_size
    while size < top:
        buckets.append(size)
        size *= 2
    return (*buckets, top)


def step_bytes_per_image(cfg: ViTConfig, grid: tuple[int, int] | None = None) -> int:
    """Bytes of the widest f32 activation of one image in a block (what a chunk bounds), at
    ``grid`` (default: the model's own) with T tokens: the MLP's hidden (and a parallel block's
    q/k/v) T x (mlp_dim (+ 3 width)), or the attention logits heads x T x T, the larger."""
    tokens = cfg.tokens_at(grid or (cfg.grid, cfg.grid))
    width = cfg.mlp_dim + (3 * cfg.width if cfg.block == "parallel" else 0)
    return 4 * max(tokens * width, cfg.heads * tokens * tokens)


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit`` (at least 1)."""
    return max(d for d in range(1, max(min(n, limit), 1) + 1) if n % d == 0)


def auto_data_devices(compute_dtype: str, platform: str, process_count: int, available: int) -> int:
    """How many devices ``mesh="auto"`` puts on the data axis."""
    if platform == "cpu" and process_count == 1:
        return min(available, CPU_DATA_PARALLEL.get(compute_dtype, available))
    return available


@dataclass(frozen=True)
class Plan:
    """Buckets, placements and chunks for one model on one mesh."""

    cfg: ViTConfig
    platform: str
    data: int  # the mesh's data axis
    buckets: tuple[int, ...]
    chunk_override: int | None = None
    max_batch_patches: int = 0  # a batch's padded patches (0: images alone bound it)
    model: int = 1  # the mesh's model axis
    fewer_rows: bool = False  # buckets may run on fewer data rows (small buckets, rows by work)
    transpose: bool = False  # CPU_TRANSPOSED_KERNELS stored transposed
    slices_override: int | None = None  # mlp_slices, where given

    @classmethod
    def make(
        cls,
        cfg: ViTConfig,
        *,
        platform: str,
        data: int,
        process_count: int,
        max_batch_images: int,
        model: int = 1,
        max_batch_patches: int = 0,
        chunk_images: int | None = None,
        small_buckets: bool | None = None,
        cpu_flags: frozenset[str] | None = None,
        transpose_kernels: bool | None = None,
        mlp_slices: int | None = None,
        midpoints: bool | None = None,
    ) -> Plan:
        """``cpu_flags``: the host's (``/proc/cpuinfo``; None: unknown); ``small_buckets`` (the
        single-process CPU host's buckets below the data axis, and rows by work),
        ``midpoints``, ``transpose_kernels`` and ``mlp_slices`` override the host's rules
        (None: the rule)."""
        if chunk_images is not None and chunk_images < 0:
            raise ValueError(f"chunk_images must be >= 0, got {chunk_images}")
        single_host_cpu = platform == "cpu" and process_count == 1
        small = single_host_cpu if small_buckets is None else small_buckets
        below = tuple(1 << k for k in range(data.bit_length()) if 1 << k < data) if small else ()
        buckets = below + batch_buckets(max_batch_images, data)
        if max_batch_patches < 0:
            raise ValueError(f"max_batch_patches must be >= 0, got {max_batch_patches}")
        if transpose_kernels and model != 1:  # the kernels' shardings name their stored axes
            raise ValueError(f"kernels stored transposed need a model axis of 1, not {model}")
        transpose = (single_host_cpu and model == 1 and cfg.compute_dtype == "bfloat16"
                     and CPU_TRANSPOSE_FLAG in (cpu_flags or ())
                     if transpose_kernels is None else transpose_kernels)
        if mlp_slices is not None and mlp_slices < 1:
            raise ValueError(f"mlp_slices must be >= 1, got {mlp_slices}")
        plan = cls(cfg, platform, data, buckets, chunk_images, max_batch_patches, model, small,
                   transpose, mlp_slices)
        if single_host_cpu if midpoints is None else midpoints:
            return replace(plan, buckets=plan.with_midpoints())
        return plan

    def with_midpoints(self) -> tuple[int, ...]:
        """The buckets, with 3a/2 between a and 2a wherever a batch of 3a/2 images would run on
        the same data rows as in 2a and compute fewer rows there (at the model's own grid)."""
        out = [self.buckets[0]]
        for a, b in zip(self.buckets, self.buckets[1:]):
            mid = a + a // 2
            if (b == 2 * a and a % 2 == 0 and self.rows(mid) == self.rows(b)
                    and self.work(mid, mid) < self.work(mid, b)):
                out.append(mid)
            out.append(b)
        return tuple(out)

    def active_steps(self, n: int, bucket: int, grid: tuple[int, int] | None = None) -> int:
        """Chunk steps ``n`` images need in ``bucket`` with each data row's share in its
        leading rows: the steps holding padding alone are skipped (``Engine.layout``)."""
        per_row = -(-n // self.rows(bucket, grid))  # ceilings
        return -(-per_row // self.chunk_images(bucket, grid))

    def work(self, n: int, bucket: int, grid: tuple[int, int] | None = None) -> int:
        """Image rows a forward of ``bucket`` computes for ``n`` images: its active chunk steps
        on each of its data rows."""
        rows, chunk = self.rows(bucket, grid), self.chunk_images(bucket, grid)
        return self.active_steps(n, bucket, grid) * chunk * rows

    @property
    def max_batch_images(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` images (a batch is padded to it)."""
        for size in self.buckets:
            if n <= size:
                return size
        raise ValueError(f"batch of {n} images exceeds the largest bucket {self.buckets[-1]}")

    def buckets_for(self, grid: tuple[int, int]) -> tuple[int, ...]:
        """The buckets whose padded batch of ``grid`` images fits ``max_batch_patches``."""
        if not self.max_batch_patches:
            return self.buckets
        return tuple(b for b in self.buckets if b * grid[0] * grid[1] <= self.max_batch_patches)

    def max_images(self, grid: tuple[int, int]) -> int:
        """The most images of ``grid`` in one batch (0: not one fits the patch budget)."""
        fits = self.buckets_for(grid)
        return fits[-1] if fits else 0

    @property
    def fold_heads(self) -> bool:
        """Attention's heads folded into its batch axis (``vit.attend``: faster on XLA:CPU),
        where the heads are not sharded: GSPMD cannot split an axis merged from two sharded
        ones and would gather q, k and v on every block."""
        return self.model == 1

    @property
    def transposed_kernels(self) -> frozenset[str]:
        """Matmul kernels the forward reads stored transposed (``vit.kernel``)."""
        return CPU_TRANSPOSED_KERNELS if self.transpose else frozenset()

    @property
    def compiler_options(self) -> dict[str, str]:
        """XLA options every forward of this plan compiles with."""
        return dict(NO_LOOP_MOTION) if self.transpose else {}

    def mlp_slices(self, bucket: int, grid: tuple[int, int] | None = None) -> int:
        """Token slices of a sequential block's MLP activation and fc2 in this bucket's steps."""
        if self.slices_override is not None:
            return self.slices_override
        if not self.transpose or self.cfg.block != "sequential":
            return 1
        tokens = self.cfg.tokens_at(grid or (self.cfg.grid, self.cfg.grid))
        rows = self.chunk_images(bucket, grid) * tokens
        return -(-rows * self.cfg.mlp_dim * 2 // CPU_MLP_SLICE_BYTES)

    def rows(self, bucket: int, grid: tuple[int, int] | None = None) -> int:
        """Data rows of the mesh a bucket of ``grid`` images runs on (default: the model's own
        grid): every row, or with ``fewer_rows`` no more than it has images, nor than get
        ``CPU_MIN_ROW_FLOPS`` of work each (a divisor of the bucket)."""
        rows = min(bucket, self.data)
        if self.fewer_rows:
            work = bucket * self.cfg.flops_per_image(grid)
            while rows > 1 and (bucket % rows or work < rows * CPU_MIN_ROW_FLOPS):
                rows -= 1
        return rows

    def chunk_images(self, bucket: int, grid: tuple[int, int] | None = None) -> int:
        """Images per data shard in each sequential step of this bucket's forward."""
        local = bucket // self.rows(bucket, grid)
        if self.chunk_override is not None:
            override = self.chunk_override
            return local if override == 0 else largest_divisor(local, override)
        if self.platform != "cpu":
            return local
        return largest_divisor(local, CPU_CHUNK_BYTES // step_bytes_per_image(self.cfg, grid))

    def table(self) -> str:
        """The plan as text: one line per bucket."""
        kernels = ", ".join(sorted(self.transposed_kernels)) or "none"
        lines = [f"plan for {self.cfg.name} on {self.platform}, data axis {self.data}, model axis "
                 f"{self.model} (attention heads {'' if self.fold_heads else 'not '}folded, "
                 f"kernels stored transposed: {kernels}):"]
        for bucket in self.buckets:
            lines.append(
                f"  bucket {bucket:>4}: {self.rows(bucket)} data rows, "
                f"{self.chunk_images(bucket)} images per shard and step"
                + (f", MLP in {self.mlp_slices(bucket)} slices" if self.mlp_slices(bucket) > 1
                   else "")
            )
        return "\n".join(lines)
