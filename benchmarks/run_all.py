"""`make bench`: run the performance benchmarks and write BENCHMARKS.md from their JSON lines.

Every figure in BENCHMARKS.md comes from this run: each benchmark's last stdout line (one JSON
object) is parsed and tabulated; the commands are listed as they ran, with the load average
before and after each. On a machine with an NVIDIA GPU the ViT-22B script runs too; elsewhere
its CPU dry run checks it and the file says so.

    python benchmarks/run_all.py              # the full run (about 25 minutes on 2 cores)
    python benchmarks/run_all.py --quick      # fewer repeats and batches: checks the plumbing
    python benchmarks/run_all.py --only decode startup      # these two; their sections to stdout
    python benchmarks/run_all.py --resume     # after a cut-short run: the finished ones kept
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import cpu_flags, cpu_model, load_average, log, plan_extras
from vit22b.server.plan import CPU_BF16_FLAGS

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {  # key -> (comparison, threshold)
    "forward ratio": (">=", 1.0),  # engine / the best runtime, batch 8 and 32, f32 and bf16
    "engine MFU": (">=", 0.85),  # of the GEMM peak measured in the same run
    "ratio_clients32_to_engine": (">=", 0.9),  # ViT-B/16: the model is what costs
    "ratio_p50_to_engine_b1_plus_delay": ("<=", 1.2),
    "ratio_batching_to_serial": (">=", 3.0),
    "tiny ratio_clients32_to_engine": (">=", 0.6),  # the tiny model: the path itself
}


def benchmarks(quick: bool, gpu: bool) -> list[tuple[str, list[str]]]:
    py = [sys.executable]
    forward = ["benchmarks/forward.py"]
    serve_b = ["benchmarks/serve.py", "--transports", "unary", "async_session"]
    serve_tiny = ["benchmarks/serve.py", "--model", "vit-22b-tiny/16", "--size", "64",
                  "--images", "1024"]
    http_tiny = ["benchmarks/serve_http.py", "--model", "vit-22b-tiny/16", "--size", "64",
                 "--images", "256"]
    if quick:
        forward += ["--batches", "1", "8", "--repeats", "2"]
        serve_b += ["--images", "32", "--repeats", "1"]
        serve_tiny += ["--repeats", "1"]
        http_tiny += ["--repeats", "1"]
    embed_ray = ["benchmarks/embed_ray.py"]
    # a job of the size Ray is for: its fixed start (about a second) weighs little there
    embed_ray_large = embed_ray + ["--images", "49152", "--repeats", "2"]
    if quick:
        embed_ray += ["--images", "1024", "--small", "256", "--repeats", "1"]
    video = ["benchmarks/video.py"] + (["--clips", "8", "--repeats", "1"] if quick else [])
    resolution = ["benchmarks/resolution.py"]
    if quick:
        resolution += ["--sizes", "224", "448", "--repeats", "1"]
    decode = ["benchmarks/decode.py"]
    startup = ["benchmarks/startup.py"]
    profile = ["benchmarks/profile_serve.py"]
    if quick:
        decode += ["--sizes", "3", "--repeats", "1", "--images", "1"]
        startup += ["--models", "vit-22b-tiny/16", "--repeats", "1"]
        profile += ["--images", "256"]
    gpu_22b = ["benchmarks/gpu_22b.py"] if gpu else ["benchmarks/gpu_22b.py", "--dry-run"]
    split = ["benchmarks/forward_profile.py", "--batch", "8", "--rows", "8"]
    return [
        ("forward", py + forward),
        ("forward_profile_f32", py + split),
        ("forward_profile_bf16", py + split + ["--dtype", "bfloat16"]),
        ("serve", py + serve_b),
        ("serve_tiny", py + serve_tiny),
        ("profile_serve", py + profile),
        ("profile_serve_session", py + profile + ["--transport", "async_session",
                                                  "--clients", "32"]),
        ("serve_http_tiny", py + http_tiny),
        ("embed_ray", py + embed_ray),
        *([] if quick else [("embed_ray_large", py + embed_ray_large)]),
        ("video", py + video),
        ("resolution", py + resolution),
        ("decode", py + decode),
        ("startup", py + startup),
        ("gpu_22b", py + gpu_22b),
    ]


def run(name: str, command: list[str]) -> dict:
    log(f"== {name}: {' '.join(command[1:])}")
    load_before = load_average()
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise SystemExit(f"{name} failed (exit {proc.returncode})")
    result = json.loads(lines[-1])
    result["_command"] = "python " + " ".join(command[1:])
    result["_seconds"] = round(seconds)
    result["_load_before"] = load_before
    return result


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def meminfo_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return -1.0


# ---- markdown ----------------------------------------------------------------------------------


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def met(value: float, target: tuple[str, float]) -> str:
    op, threshold = target
    ok = value >= threshold if op == ">=" else value <= threshold
    return f"{value:.3g} ({op} {threshold}: {'met' if ok else 'NOT met'})"


def _load(r: dict) -> str:
    after = r.get("machine", {}).get("load_avg_1m", r.get("load_average_after", "?"))
    return f"load average {r.get('_load_before', '?')} before, {after} after"


def forward_section(r: dict) -> str:
    peaks, theory = r["matmul_gflops"], r["theoretical_peak"]
    rows = [
        [
            row["dtype"], row["batch"], row["engine_images_per_s"],
            f"{row['engine_mesh']}, bucket {row['engine_bucket']}, "
            f"chunk {row['engine_chunk_images']}{plan_extras(row)}",
            row["peer"], row["peer_images_per_s"],
            ", ".join(f"{k} {v}" for k, v in row["peers_images_per_s"].items()),
            f"**{row['ratio']}**", row["engine_mfu"], row["peer_mfu"],
            row["engine_mfu_theoretical"], row["peer_mfu_theoretical"],
            ", ".join(f"{k} {v}" for k, v in row["pooled_rel_err"].items()),
        ]
        for row in r["rows"]
    ]
    header = ["dtype", "batch", "engine img/s", "engine plan (chosen by itself)", "best peer",
              "peer img/s", "all peers img/s", "engine / best", "engine MFU (measured peak)",
              "best peer MFU (measured)", "engine MFU (theoretical)",
              "best peer MFU (theoretical)", "pooled rel. err. vs each peer"]
    skipped = [f"{dtype} {name}: {why}" for dtype, peers in r.get("skipped_peers", {}).items()
               for name, why in peers.items()]
    over = [d for d in ("float32", "bfloat16")
            if peaks.get(f"peak_{d}", 0) > theory[f"peak_{d}"]]
    clock_note = (
        f" The measured GEMM beats this 'peak' in {', '.join(over)}: the clock /proc/cpuinfo "
        "reports is the nominal one (a hypervisor's TSC), and the cores run faster (boost); the "
        "theoretical MFU is then an upper bound, the measured-peak MFU the figure to read."
        if over else ""
    )
    return "\n\n".join([
        f"## Engine forward vs the CPU runtimes ({r['model']}, {r['flops_per_image'] / 1e9:.1f} "
        f"GFLOP/image)",
        f"`{r['_command']}` ({r['_seconds']} s, {r['repeats']} alternating repeats, medians; "
        f"{_load(r)})",
        "Peers (`benchmarks/runtimes.py`), all on the same Hugging Face `ViTModel` weights "
        "(seeded init; the engine runs them through `model/convert_hf.py`): torch eager (f32; "
        "bf16 weights, and f32 weights under `torch.autocast(bfloat16)`), torch.compile "
        "(Inductor with freezing, static shapes; f32 and bf16 autocast), ONNX Runtime (the "
        "graph exported once by `torch.onnx.export`, CPU provider, all optimisations, f32), "
        "OpenVINO (that ONNX file, static shapes, inference precision f32 or bf16). The ratio "
        "is against the best peer of each dtype and batch. MFU: achieved FLOP/s over (a) the "
        "best GEMM measured in this run, same dtype, of XLA, torch and OpenVINO (cubes of "
        "1024, 2048, 4096 and ViT-B/16's MLP GEMMs; bf16 inputs, f32 accumulation, written in "
        "f32 by XLA and in bf16 by torch and OpenVINO; GFLOP/s: "
        + ", ".join(f"{k} {v}" for k, v in peaks.items()) + ") and "
        f"(b) the theoretical peak, {theory['assumption']}: {theory['peak_float32']} (f32) / "
        f"{theory['peak_bfloat16']} (bf16) GFLOP/s.{clock_note}",
        table(header, rows),
        ("Peers skipped: " + "; ".join(skipped) + ".") if skipped else "",
    ]).rstrip() + "\n"


SERVE_NOTES = {
    "serve": "The model is what costs here: the serving path's figures are the issue's targets. "
    "Next to a ViT-B forward the per-call cost is small, so dynamic batching gives about what the "
    "model itself gains from batching on this CPU (the row below it), far from 3x: "
    "single-image calls already run it at most of its batched speed.",
    "serve_tiny": "The tiny model costs under a millisecond: these figures are the serving "
    "path's own per-call cost (gRPC, the SDK, decoding, batching), not the model's.",
}


# serve.py's phase prefixes -> what carries each call (benchmarks/serve.py, drive())
TRANSPORT_LABELS = {
    "": "unary call (`FeatureClient.embed`, a thread each)",
    "session_": "session message (`FeatureClient.session()`, a thread each)",
    "async_session_": "session message (`AsyncFeatureClient.session()`, a task each)",
}


def _spread(r: dict, phase: str) -> str:
    """A phase's range of paired ratios to the engine (serve.py), where the run recorded it."""
    low_high = r.get(phase, {}).get("ratio_to_engine_range")
    return f"; paired runs {low_high[0]}-{low_high[1]}" if low_high else ""


def serve_section(r: dict, note: str = "", clients_target: str = "ratio_clients32_to_engine"
                  ) -> str:
    spread = r.get("engine_images_per_s_range")
    rows = [["engine (in process, batches of "
             f"{r['max_batch_images']})", r["engine_images_per_s"], "", "", "",
             f"batch-1 {r['engine_batch1_ms']} ms"
             + (f"; runs {spread[0]:.0f}-{spread[1]:.0f} img/s" if spread else "")]]
    for prefix, calls in TRANSPORT_LABELS.items():
        for clients in (1, 8, 32):
            if s := r.get(f"{prefix}clients_{clients}"):
                rows.append([f"{clients} client(s), 1 image per {calls}", s["images_per_s"],
                             s["p50_ms"], s["p99_ms"], s["avg_batch"], ""])
    s = r["bulk"]
    rows.append([f"SDK bulk ({r['max_batch_images']} images/call, 4 in flight)",
                 s["images_per_s"], "", "", s["avg_batch"], ""])
    ratios = [
        ["gRPC at 32 clients / engine", met(r["ratio_clients32_to_engine"],
                                            TARGETS[clients_target]) + _spread(r, "clients_32")],
        ["1-client p50 / (engine batch-1 + max_delay_ms)",
         met(r["ratio_p50_to_engine_b1_plus_delay"],
             TARGETS["ratio_p50_to_engine_b1_plus_delay"])],
    ]
    for transport in ("session", "async_session"):
        if f"ratio_{transport}_clients32_to_engine" in r:
            ratios += [
                [f"32 clients / engine, {transport.replace('_', ' ')}s",
                 met(r[f"ratio_{transport}_clients32_to_engine"], TARGETS[clients_target])
                 + _spread(r, f"{transport}_clients_32")],
                [f"1-client p50 / (engine batch-1 + max_delay_ms), {transport.replace('_', ' ')}",
                 met(r[f"ratio_{transport}_p50_to_engine_b1_plus_delay"],
                     TARGETS["ratio_p50_to_engine_b1_plus_delay"])],
            ]
    ratios += [
        ["32 clients / serial single-image calls (unary)",
         met(r["ratio_batching_to_serial"], TARGETS["ratio_batching_to_serial"])],
        ["the model's own gain from batching: engine batched / engine batch-1",
         f"{r['engine_batched_to_batch1']}"],
        ["SDK bulk / engine", f"{r['ratio_bulk_to_engine']}" + _spread(r, "bulk")],
    ]
    return "\n\n".join([
        f"## Serving path: gRPC end to end vs the engine ({r['model']}, mesh {r['mesh']})",
        f"`{r['_command']}` ({r['_seconds']} s, {r['repeats']} alternating repeats of "
        f"{r['images']} JPEGs of {r['jpeg_side']}x{r['jpeg_side']}, medians; ratios to the "
        "engine paired with its runs just before and after each phase; max_delay_ms "
        f"{r['max_delay_ms']}, batch wait {r.get('batch_wait', 'delay')}; {_load(r)}). Clients "
        "run in a separate process, one channel each; average batch from the server's "
        "`vit22b_batch_images` metric.",
        table(["side", "img/s", "p50 ms", "p99 ms", "avg batch", ""], rows),
        table(["ratio", "value (target)"], ratios),
        note,
    ]).rstrip() + "\n"


def embed_ray_section(r: dict) -> str:
    rows = [[name, r[f"{name}_images_per_s"], r[f"{name}_rate_images_per_s"],
             r[f"{name}_fixed_s"]] for name in ("threads", "ray")]
    ratios = [
        [f"Ray / threads, end to end at {r['images']} images", met(r["ratio_ray_to_threads"],
                                                                   (">=", r["target_ratio"]))],
        ["Ray / threads, rate after the fixed cost", met(r["ratio_ray_to_threads_rate"],
                                                         (">=", r["target_ratio"]))],
        [f"job size where end to end reaches {r['target_ratio']}",
         r["break_even_images"] or "never, at these rates"],
    ]
    return "\n\n".join([
        f"## Batch job: `vit22b embed --runner ray` vs the threads runner ({r['model']} model, "
        f"{r['images']} images)",
        f"`{r['_command']}` ({r['_seconds']} s, {r['repeats']} alternating repeats, medians; "
        f"{r['images']} and {r['small_images']} JPEGs of {r['image_size'][0]}x"
        f"{r['image_size'][1]} through one `vit22b serve`, batch {r['batch_size']}, shards of "
        f"{r['shard_size']}, {r['concurrency']} requests in flight on each side; ray "
        f"{r['ray']}; load average {r['_load_before']} before, {r['load_average_after']} after)."
        " Each side's wall time is split into a fixed cost per job and a rate from its two job "
        "sizes; the Ray side's fixed cost is Ray Data starting its executor and actor pool.",
        table(["runner", f"img/s end to end ({r['images']})", "img/s rate", "fixed s"], rows),
        table(["ratio", "value (target)"], ratios),
    ])


def http_section(r: dict) -> str:
    rows = [[f"{door} ({'SDK' if door == 'grpc' else 'httpx, JSON'})", clients,
             s["images_per_s"], s["p50_ms"], s["p99_ms"], s["avg_batch"]]
            for clients in (1, 32) for door in ("grpc", "http")
            for s in [r[f"{door}_clients_{clients}"]]]
    return "\n\n".join([
        f"## HTTP `/v1/features` vs gRPC `Embed` ({r['model']}, mesh {r['mesh']})",
        f"`{r['_command']}` ({r['_seconds']} s, {r['repeats']} repeats of {r['images']} JPEGs of "
        f"{r['jpeg_side']}x{r['jpeg_side']}, doors alternating, medians; one image per call; "
        f"load average {r['_load_before']} before, {r['machine']['load_avg_1m']} after). One "
        "server runs both doors; clients in a separate process, one connection each.",
        table(["door", "clients", "img/s", "p50 ms", "p99 ms", "avg batch"], rows),
        table(["ratio", "value"], [
            ["HTTP / gRPC at 1 client", r["ratio_http_to_grpc_1"]],
            ["HTTP / gRPC at 32 clients", r["ratio_http_to_grpc_32"]],
        ]),
    ])


def video_section(r: dict) -> str:
    c, per_video = r["clip"], round(1000 / r["job_videos_per_s"], 2)
    rows = [
        ["decode: PyAV demux + decode, RGB of the sampled frames", r["decode_videos_per_s"],
         r["decode_ms_per_video"]],
        ["compute: the facade on the decoded frames (preprocess + forward)",
         r["compute_videos_per_s"], r["compute_ms_per_video"]],
        ["job: `run_job` with `--frames`, decoding in the workers", r["job_videos_per_s"],
         per_video],
    ]
    return "\n\n".join([
        f"## Video: {r['frames_per_clip']}-frame clips through the batch job ({r['model']}, "
        f"mesh {r['mesh']})",
        f"`{r['_command']}` ({r['_seconds']} s, {r['repeats']} repeats, medians; {r['clips']} "
        f"{c['codec']} MP4 clips of {c['frames']} frames, {c['width']}x{c['height']} at "
        f"{c['fps']:g} fps, {r['frames_per_clip']} frames sampled from each; "
        f"{r['concurrency']} workers, batches of {r['batch_size']} frames; load average "
        f"{r['_load_before']} before, {r['machine']['load_avg_1m']} after).",
        table(["side", "videos/s", "ms per video"], rows),
        f"Decoding's share of the serial time, decode / (decode + compute): "
        f"**{r['decode_share']}**. The job moved {r['job_frames_per_s']} frames/s. Decoding "
        "runs every frame of a clip (inter-frame codecs), not only the sampled ones; next to "
        f"this model's forward it is {'most' if r['decode_share'] > 0.5 else 'less than half'} "
        "of a video's cost.",
    ])


def resolution_section(r: dict) -> str:
    rows = [[row["size"], row["tokens"], row["engine_images_per_s"], row["engine_ms_per_patch"],
             row["torch_images_per_s"], row["torch_ms_per_patch"], row["ratio"],
             row["pooled_rel_err"]] for row in r["rows"]]
    timing = f"{r['_seconds']} s, " if "_seconds" in r else ""
    before = f"{r['_load_before']} before, " if "_load_before" in r else ""
    fit = "; ".join(f"{side}: {f['ms_per_token']} ms x T + {f['ms_per_token_squared']} ms x T^2"
                    for side, f in r["fit"].items())
    return "\n\n".join([
        f"## Cost against resolution ({r['model']}, {r['compute_dtype']}, engine mesh "
        f"{r['engine_mesh']})",
        f"`{r['_command']}` ({timing}batch {r['batch']}, {r['repeats']} alternating "
        f"repeats, medians; load average {before}{r['machine']['load_avg_1m']} at the end). "
        "The peer is Hugging Face `ViTModel` with "
        "`interpolate_pos_encoding=True` on the same weights; T is the tokens per image. "
        f"Least-squares fit of ms per image: {fit}.",
        table(["px", "T", "engine img/s", "engine ms/patch", "torch img/s", "torch ms/patch",
               "engine / torch", "pooled rel. err."], rows),
    ])


def gpu_section(r: dict) -> str:
    head = "## ViT-22B/14 bf16 on one GPU (`benchmarks/gpu_22b.py`)"
    if r["dry_run"]:
        return "\n\n".join([
            head,
            "**Not run on a GPU**: this machine has none. The script's logic ran as a CPU dry "
            f"run (`{r['_command']}`, {r['model']}, batches "
            f"{[row['batch'] for row in r['rows']]}): the timm peer's weights converted through "
            "the importer agree with the engine (pooled rel. err. "
            f"{[row.get('pooled_rel_err') for row in r['rows']]}). Its speed figures mean "
            "nothing for a GPU and are not reported.",
        ])
    rows = [[row["batch"], row["engine_images_per_s"], row["engine_mfu"],
             row["engine_mfu_datasheet"], row.get("peer_images_per_s", ""),
             row.get("peer_mfu", ""), row.get("ratio", "")] for row in r["rows"]]
    return "\n\n".join([
        head,
        f"`{r['_command']}` on {r['device_kind']}; bf16 GEMM peak measured in the run: "
        f"{r['matmul_gflops']['peak_bfloat16']} GFLOP/s. Peer: {r['peer'] or r['peer_error']}.",
        table(["batch", "engine img/s", "engine MFU (measured peak)", "engine MFU (datasheet)",
               "peer img/s", "peer MFU", "ratio"], rows),
    ])


def forward_profile_section(r: dict) -> str:
    rows = [[row["label"], row["ms"], f"{row['share']:.1%}", row["calls"]]
            for row in r["rows"][:8]]
    return "\n\n".join(filter(None, [
        f"## Where the engine's forward spends its time ({r['model']}, {r['dtype']}, batch "
        f"{r['batch']})",
        f"`{r['_command']}` ({_load(r)}). XLA:CPU's own trace of each executed operation, "
        f"summed by what it computes (the blocks' copies of one operation are one row): "
        f"device-ms per forward over the {r['devices']} data devices (they run at the same "
        f"time; wall {r['wall_ms']} ms per forward). Plain GEMMs: **{r['gemm_share']:.1%}** of "
        f"the {r['traced_device_ms']} device-ms traced.",
        table(["operation [jax op]", "device-ms", "share", "calls"], rows),
        _concurrency(r),
    ]))


def _concurrency(r: dict) -> str:
    """The profile's split of a forward by how many operations ran at once, where recorded."""
    split = r.get("concurrency_ms")
    if not split:
        return ""
    parts = ", ".join(f"{n} running {ms} ms" for n, ms in split.items())
    return (f"The traced span per forward by how many operations ran at once (a device idles "
            f"while fewer than {r['devices']} run): {parts}.")


def _prefix(transport: str) -> str:
    return "" if transport == "unary" else f"{transport}_"


def _collections(r: dict, phase: dict) -> str:
    """The server's cycle collections in a profiled phase, where the run recorded them."""
    if "server_cycle_collections" not in phase:
        return ""
    heap = "frozen" if r.get("startup_heap_frozen", True) else "not frozen"
    seen = ", ".join(f"{g} {v['collections']}x, {v['ms']} ms"
                     for g, v in phase["server_cycle_collections"].items())
    return f" Cycle collections in the phase (the start-up heap {heap}): {seen or 'none'}."


def profile_section(r: dict) -> str:
    parts = [
        f"## Where a served call's time goes ({r['model']}, JPEGs of {r['jpeg_side']}x"
        f"{r['jpeg_side']}, {TRANSPORT_LABELS[_prefix(r.get('transport', 'unary'))]})",
        f"`{r['_command']}` ({r['_seconds']} s, {r['images']} single-image calls per phase; "
        f"{_load(r)}). CPU microseconds per image of each process, by thread, from /proc "
        "(exact); then the share of py-spy's samples by stage (the innermost matching frame; "
        "on a loaded machine a runnable thread waiting for a core is sampled as busy, so the "
        "shares are indicative, the /proc figures are not).",
    ]
    for key in sorted(k for k in r if k.startswith("clients_")):
        phase = r[key]
        for side in ("server", "client"):
            cpu, sampled = phase[side]["cpu"], phase[side]["sampled"]["stages"]
            rows = [[group, us] for group, us in cpu["threads"].items()]
            stages = ", ".join(f"{stage} {v['percent']}%" for stage, v in sampled.items()
                               if v["percent"] >= 1.0)
            seen = _collections(r, phase) if side == "server" else ""
            parts += [
                f"**{key.split('_')[1]} client(s), {side}**: {cpu['cpu_us_per_image']} CPU us "
                f"per image ({phase['images_per_s']} img/s, average batch {phase['avg_batch']})."
                f" Sampled stages: {stages}.{seen}",
                table(["thread", "CPU us / image"], rows),
            ]
    return "\n\n".join(parts)


def decode_section(r: dict) -> str:
    rows = [[row["model"], f"{row['megapixels']} MP ({row['size']}, {row['jpeg_kb']} KiB)",
             f"{row['resize']} -> {row['crop']}", row["full_images_per_s"],
             row["draft_images_per_s"], f"**{row['ratio_draft_to_full']}**",
             row["decoded_size"], f"{row['max_abs_levels']} / {row['mean_abs_levels']}",
             f"{row['max_abs_input']} / {row['mean_abs_input']}",
             row.get("pooled_rel_diff", ""),
             f"{row['heic_images_per_s']} ({row['heic_kb']} KiB)" if "heic_kb" in row else "-",
             row.get("ratio_heic_to_jpeg", "-")] for row in r["rows"]]
    return "\n\n".join([
        "## Decoding real photos: full decoding vs JPEG DCT scaling (`Image.draft`)",
        f"`{r['_command']}` ({r['_seconds']} s, {r['images']} photo-like JPEGs per size, "
        f"{r['repeats']} alternating repeats, medians; one thread: images/s per core; "
        f"{_load(r)}). Decode + resize + crop + normalise (`Preprocessor.load`); 'draft' is the "
        "pixel contract (rules v3: the largest DCT scale that divides both sides and keeps "
        "them >= 2x the resize's shorter side). Differences of the model input against full "
        "decoding, in 8-bit levels and in normalised units; the pooled-feature relative "
        "difference on the tiny model (seeded weights). HEIC: the same photos as phones "
        "write them (quality 90, 512x512 tiles), decoded whole by libheif (no reduced-size "
        "decoding), against the JPEG's contract ('draft').",
        table(["model", "photo", "resize -> crop", "full img/s/core", "draft img/s/core",
               "draft / full", "decoded at", "input diff max / mean (levels)",
               "input diff max / mean (normalised)", "pooled rel. diff (tiny)",
               "HEIC img/s/core (size)", "HEIC / draft"], rows),
    ])


def startup_section(r: dict) -> str:
    rows = [[model, v["cold_s"], v["warm_s"], v["ratio_warm_to_cold"], v["cache_entries"],
             v.get("local_job_cold_s", "-"), v.get("local_job_warm_s", "-"),
             v.get("init_cold_s", "-"), v.get("init_warm_s", "-")]
            for model, v in r["models"].items()]
    return "\n\n".join([
        "## Start-up: process start to SERVING, cold and with the compilation cache",
        f"`{r['_command']}` ({r['_seconds']} s; {_load(r)}). `vit22b serve --compile-cache DIR`"
        ": cold is an empty cache folder, warm the median of the next starts reusing it; a "
        "one-image `vit22b embed --local` job and `vit22b init` the same way, start to exit.",
        table(["model", "cold s", "warm s", "warm / cold", "cache entries", "local job cold s",
               "local job warm s", "init cold s", "init warm s"], rows),
    ])


def summary_section(results: dict) -> str:
    rows = []
    f = results.get("forward")
    if f:
        emulated = emulated_bf16(f["machine"])
        for row in f["rows"]:
            if row["batch"] in (8, 32):
                label = f"{f['model']} {row['dtype']} batch {row['batch']}"
                if row["dtype"] == "bfloat16" and emulated:
                    rows.append([f"engine MFU of the measured GEMM peak, {label}",
                                 f"{row['engine_mfu']} (no target: this CPU has no bf16 "
                                 "instructions, so `vit22b serve` computes float32, "
                                 "`--compute-dtype auto`; no peer ran in bf16)"])
                    continue
                peer = f" ({row['peer']})" if row["peer"] else ""
                rows.append([f"engine / best runtime{peer}, {label}",
                             met(row["ratio"], TARGETS["forward ratio"])
                             if row["ratio"] is not None
                             else "no peer ran (each skipped, with its reason, below)"])
                if row["engine_mfu"] is not None:
                    rows.append([f"engine MFU of the measured GEMM peak, {label}",
                                 met(row["engine_mfu"], TARGETS["engine MFU"])])
    s = results.get("serve")
    if s:
        for key in ("ratio_clients32_to_engine", "ratio_p50_to_engine_b1_plus_delay",
                    "ratio_batching_to_serial"):
            rows.append([f"{key} ({s['model']})", met(s[key], TARGETS[key])])
    t = results.get("serve_tiny")
    if t:
        rows.append([f"ratio_clients32_to_engine ({t['model']})",
                     met(t["ratio_clients32_to_engine"],
                         TARGETS["tiny ratio_clients32_to_engine"])])
        rows.append([f"ratio_p50_to_engine_b1_plus_delay ({t['model']})",
                     met(t["ratio_p50_to_engine_b1_plus_delay"],
                         TARGETS["ratio_p50_to_engine_b1_plus_delay"])])
        if "ratio_async_session_clients32_to_engine" in t:
            rows.append([f"ratio_async_session_clients32_to_engine ({t['model']})",
                         met(t["ratio_async_session_clients32_to_engine"],
                             TARGETS["tiny ratio_clients32_to_engine"])])
    for key in ("embed_ray", "embed_ray_large"):
        r = results.get(key)
        if r:
            rows.append([f"Ray runner / threads runner, end to end at {r['images']} images",
                         met(r["ratio_ray_to_threads"], (">=", r["target_ratio"]))])
    return "## Targets, this run\n\n" + table(["figure", "value"], rows)


def emulated_bf16(machine: dict) -> bool:
    """Whether the run's CPU has no bf16 instructions: there XLA emulates bf16, and `vit22b
    serve` computes a bf16 model in float32 (`--compute-dtype auto`)."""
    return not set(machine["isa"]) & CPU_BF16_FLAGS


EMULATED_BF16 = (
    "This CPU has no bf16 instructions. The presets benchmarked here compute in bfloat16, "
    "which XLA emulates on it: the engines the serving, job, video, resolution and start-up "
    "benchmarks load, and the forward's bfloat16 rows, ran emulated bfloat16 (the same on both "
    "sides of each ratio), where `vit22b serve` computes float32 (`--compute-dtype auto`, the "
    "default). The bfloat16 forward is no target on such a CPU.")

SECTIONS = {
    "forward": forward_section,
    "forward_profile_f32": forward_profile_section,
    "forward_profile_bf16": forward_profile_section,
    "serve": lambda r: serve_section(r, SERVE_NOTES["serve"]),
    "serve_tiny": lambda r: serve_section(r, SERVE_NOTES["serve_tiny"],
                                          "tiny ratio_clients32_to_engine"),
    "profile_serve": profile_section,
    "profile_serve_session": profile_section,
    "serve_http_tiny": http_section,
    "embed_ray": embed_ray_section,
    "embed_ray_large": embed_ray_section,
    "video": video_section,
    "decode": decode_section,
    "startup": startup_section,
    "resolution": resolution_section,
    "gpu_22b": gpu_section,
}


def write_markdown(results: dict, started: str, quick: bool, kept: list[str] = ()) -> str:
    m = results["forward"]["machine"]
    isa = cpu_flags()
    amx = "" if any(flag.startswith("amx") for flag in isa) else " (no AMX)"
    versions = ", ".join(f"{k} {m[k]}" for k in ("python", "jax", "jaxlib", "torch",
                                                 "transformers", "grpc") if k in m)
    parts = [
        "# Benchmarks",
        f"Written by `make bench` (`python benchmarks/run_all.py{' --quick' if quick else ''}`)"
        f" on {started}. Every figure below comes from this one run; ratios compare sides "
        "measured in the same process, alternating, after warm-up. Notes on every attempt "
        "behind these figures: [benchmarks/NOTES.md](benchmarks/NOTES.md)."
        + (f" Resumed (`--resume`): {', '.join(kept)} kept from the run this one continues."
           if kept else ""),
        "## Machine",
        table(["", ""], [
            ["CPU", f"{cpu_model()}, {m['cores']} cores, ISA: {', '.join(isa)}{amx}"],
            ["memory", f"{meminfo_gb()} GiB"],
            ["GPU", "none" if results["gpu_22b"]["dry_run"] else results["gpu_22b"]["device_kind"]],
            ["software", versions],
        ]),
        *([EMULATED_BF16] if emulated_bf16(m) else []),
        summary_section(results),
        *(SECTIONS[name](r) for name, r in results.items()),
        "## Commands\n\n" + "\n".join(
            f"    {r['_command']}    # {_load(r)}" for r in results.values()),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument("--save", default=str(ROOT / "build" / "bench"),
                        help="each benchmark's result (JSON) is kept here as it finishes")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the results kept in --save instead of running them again")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS),
                        help="run these benchmarks and print their sections (and JSON lines) "
                        "instead of writing BENCHMARKS.md")
    parser.add_argument("--render", nargs="+", metavar="NAME=FILE",
                        help="print the sections of saved results (a benchmark's JSON line, "
                        "with _command/_seconds/_load_before added) instead of running")
    args = parser.parse_args(argv)
    if args.render:
        for spec in args.render:
            name, _, path = spec.partition("=")
            lines = Path(path).read_text().strip().splitlines()
            print(SECTIONS[name](json.loads(lines[-1])) + "\n")
        return 0
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if args.only:
        for name, command in benchmarks(args.quick, has_gpu()):
            if name in args.only:
                result = run(name, command)
                print(json.dumps(result), file=sys.stderr, flush=True)
                print(SECTIONS[name](result) + "\n", flush=True)
        return 0
    saved = Path(args.save)
    saved.mkdir(parents=True, exist_ok=True)
    results, kept = {}, []
    for name, command in benchmarks(args.quick, has_gpu()):
        path = saved / f"{name}.json"
        if args.resume and path.exists():  # a run cut short goes on where it stopped
            results[name] = json.loads(path.read_text())
            kept.append(name)
            log(f"== {name}: kept from {path}")
            continue
        results[name] = run(name, command)
        path.write_text(json.dumps(results[name]))
    Path(args.out).write_text(write_markdown(results, started, args.quick, kept))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
