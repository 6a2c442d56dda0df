"""The CPU inference runtimes a user would pick for the peer model, each optional.

Every runner takes NCHW float32 numpy pixels and returns the pooled (class-token) features of the
last layer as float32 numpy, from the same Hugging Face ``ViTModel`` weights:

- ``torch eager``: f32; bf16 as bf16 weights and as f32 weights under ``torch.autocast``;
- ``torch.compile``: Inductor with ``freezing`` (weights folded and prepacked for oneDNN, the
  setting PyTorch recommends for CPU inference), static shapes (one compile per batch size); f32,
  and bf16 under ``torch.autocast``;
- ``onnxruntime``: the peer's graph exported once (``torch.onnx.export``, dynamic batch), CPU
  provider, every graph optimisation, one intra-op thread per core; f32 only (its CPU provider
  has no bf16 GEMMs);
- ``openvino``: that ONNX file read by OpenVINO, reshaped to each batch size (static shapes are
  its fast path), ``INFERENCE_PRECISION_HINT`` f32 or bf16 on the CPU plugin.

A runtime that is not installed (or fails to set up) is skipped with a note saying why; ``make
bench`` installs them all (the ``bench`` extra). So is a bf16 peer that has no bf16 kernels on
this CPU (no avx512_bf16 / AMX): torch's bf16 GEMM then runs at about 1 GFLOP/s (a ViT-B/16
measurement would take hours), and OpenVINO's CPU plugin, lacking its ``BF16`` capability, runs
its bf16 hint in f32, which the f32 table already measures.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from benchlib import log, openvino_bf16_shortfall

Runner = Callable[[np.ndarray], np.ndarray]
TORCH_BF16 = ("torch eager bf16 weights", "torch eager autocast", "torch.compile autocast")


def pooled_module(model):
    """``model(pixel_values=x).last_hidden_state[:, 0]`` as a torch module: one graph to compile
    and export, with the same output for every runtime."""
    import torch

    class Pooled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            return self.inner(pixel_values=pixel_values).last_hidden_state[:, 0]

    return Pooled(model).eval()


def _torch_runner(module, cast=None, autocast: bool = False) -> Runner:
    import torch

    def run(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(x)
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = module(t if cast is None else t.to(cast))
        return out.float().numpy()

    return run


def _compiled_runner(module, autocast: bool) -> Runner:
    import torch
    import torch._inductor.config as inductor

    inductor.freezing = True
    compiled = torch.compile(module, dynamic=False)
    return _torch_runner(compiled, autocast=autocast)


def export_onnx(module, image_size: int, folder: str) -> str:
    """The peer's graph as ONNX, once, with a dynamic batch axis; returns the file's path."""
    import torch

    path = str(Path(folder) / "peer.onnx")
    if os.path.exists(path):
        return path
    x = torch.zeros(2, 3, image_size, image_size)
    batch = torch.export.Dim("batch", min=1, max=4096)
    start = time.perf_counter()
    torch.onnx.export(module, (x,), path, dynamo=True, input_names=["pixel_values"],
                      output_names=["pooled"], dynamic_shapes=({0: batch},),
                      external_data=False, verbose=False)
    log(f"exported the peer to ONNX in {time.perf_counter() - start:.0f}s")
    return path


def _onnxruntime_runner(path: str) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"pixel_values": x})[0]


def _openvino_runner(path: str, precision: str) -> Runner:
    import openvino as ov

    core = ov.Core()
    compiled: dict[tuple, object] = {}

    def run(x: np.ndarray) -> np.ndarray:
        if x.shape not in compiled:  # static shapes: OpenVINO's fast path (warm-up compiles)
            model = core.read_model(path)
            model.reshape({"pixel_values": list(x.shape)})
            compiled[x.shape] = core.compile_model(
                model, "CPU", {"INFERENCE_PRECISION_HINT": precision}
            )
        return np.asarray(compiled[x.shape](x)[0], np.float32)

    return run


def torch_bf16_shortfall(n: int = 512) -> str | None:
    """Why torch has no usable bf16 GEMM here (its rate far below its f32 one), or None."""
    import torch

    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(n, n, dtype=dtype)
        torch.mm(a, a)
        start = time.perf_counter()
        torch.mm(a, a)
        rates[dtype] = 2 * n**3 / (time.perf_counter() - start) / 1e9
    f32, bf16 = rates[torch.float32], rates[torch.bfloat16]
    if bf16 >= f32 / 4:
        return None
    return (f"no bf16 kernels on this CPU: torch's {n}-cube bf16 GEMM {bf16:.1f} GFLOP/s "
            f"against {f32:.1f} in f32")


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def runners(peer, dtype: str, image_size: int, folder: str) -> tuple[dict[str, Runner],
                                                                      dict[str, str]]:
    """(name -> runner, name -> why it was skipped) for ``dtype`` ("float32" or "bfloat16");
    ``folder`` holds the ONNX export."""
    import torch

    module = pooled_module(peer)
    ready: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    onnx: list[str] = []  # the exported file, once

    def onnx_file() -> str:
        if not onnx:
            onnx.append(export_onnx(module, image_size, folder))
        return onnx[0]

    def add(name: str, requires: tuple[str, ...], make: Callable[[], Runner]) -> None:
        missing = _missing(requires)
        if missing:
            skipped[name] = f"{', '.join(missing)} not installed (`make bench` installs it)"
            return
        try:
            ready[name] = make()
        except Exception as err:  # noqa: BLE001 - a peer that cannot start is reported
            skipped[name] = f"set-up failed: {type(err).__name__}: {str(err)[:200]}"

    exported = ("onnx", "onnxscript")  # torch.onnx.export's own requirements
    if dtype == "float32":
        ready["torch eager"] = _torch_runner(module)
        add("torch.compile", (), lambda: _compiled_runner(copy.deepcopy(module), False))
        add("onnxruntime", (*exported, "onnxruntime"), lambda: _onnxruntime_runner(onnx_file()))
        add("openvino f32", (*exported, "openvino"), lambda: _openvino_runner(onnx_file(), "f32"))
    else:
        torch_why = torch_bf16_shortfall()
        if torch_why:
            skipped.update(dict.fromkeys(TORCH_BF16, torch_why))
        else:
            bf16 = copy.deepcopy(module).to(torch.bfloat16)
            ready["torch eager bf16 weights"] = _torch_runner(bf16, torch.bfloat16)
            ready["torch eager autocast"] = _torch_runner(module, autocast=True)
            add("torch.compile autocast", (),
                lambda: _compiled_runner(copy.deepcopy(module), True))
        openvino_why = not _missing(("openvino",)) and openvino_bf16_shortfall()
        if openvino_why:
            skipped["openvino bf16"] = openvino_why
        else:
            add("openvino bf16", (*exported, "openvino"),
                lambda: _openvino_runner(onnx_file(), "bf16"))
    return ready, skipped
