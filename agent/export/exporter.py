"""Cut a model into pipeline-stage IRs (or one GenAI-compatible whole-model IR).

Each stage is exported in its own short-lived process by default, reading only its own
tensors, so peak memory is about one stage, never the whole model. The result directory
holds ``stage_<i>/{model.xml, model.bin, manifest.json}``, the tokenizer, ``config.json``
and ``export.json``; it is assembled in a temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.common.hashing import sha256_file
from agent.common.paths import exports_dir
from agent.common.progress import step
from agent.export.stage_module import StageSpec
from agent.models.store import LocalModel

log = logging.getLogger(__name__)

EXPORT_VERSION = 5
# Of the vocabulary head's rows, the share a split's stage 0 holds a copy of, to compute beside
# the last stage while a lone stream's step is there (the last stage then computes the rest).
# Under half: stage 0's part waits for two hops the last stage's part does not.
HEAD_SHARE = 0.4
HEAD_FILES = ("head.xml", "head.bin")
WEIGHTS = ("fp32", "fp16", "int8", "int4")
# How far into a stage's export each phase the worker announces begins, for the progress a
# coordinator shows while it waits: rough shares of its time (SmolLM2 on a laptop CPU: starting
# the worker and its libraries ~20%, converting ~10-30%, compressing to int8 ~25%, saving ~5-20%).
PHASES = (
    ("reading tensors", 0.2),
    ("converting to OpenVINO", 0.3),
    ("compressing weights", 0.5),
    ("saving", 0.8),
    ("converting the head part", 0.85),
)
# export progress: (stage index, stages, fraction of that stage done, what it does now)
ExportProgress = Callable[[int, int, float, str | None], None]


class ExportError(RuntimeError):
    pass


@dataclass(frozen=True)
class ExportOptions:
    weights: str = "int4"
    group_size: int = 128
    beam_idx: bool = True
    genai: bool = False  # one whole-model IR with full logits, loadable by openvino_genai.LLMPipeline

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ExportError(f"unknown weights {self.weights!r}: choose one of {', '.join(WEIGHTS)}")
        if self.group_size < 1 and self.group_size != -1:
            raise ExportError("group size must be positive (or -1 for per-channel)")

    def tag(self) -> str:
        t = self.weights + (f"-g{self.group_size}" if self.weights == "int4" else "")
        if not self.beam_idx:
            t += "-nobeam"
        if self.genai:
            t += "-genai"
        return t


@dataclass(frozen=True)
class ExportResult:
    dir: Path
    manifests: list[dict[str, Any]]

    def stage_dirs(self) -> list[Path]:
        return [self.dir / f"stage_{i}" for i in range(len(self.manifests))]


def default_export_dir(model: LocalModel, ranges: list[tuple[int, int]], opts: ExportOptions) -> Path:
    split = "_".join(f"{a}-{b}" for a, b in ranges)
    return exports_dir() / f"{model.name}-{model.sha256[:12]}" / f"{opts.tag()}-{split}"


def load_export(d: Path) -> ExportResult | None:
    """A complete export at ``d`` (export.json and every stage's manifest and files), or None."""
    try:
        meta = json.loads((d / "export.json").read_text())
        mans = [json.loads((d / f"stage_{i}" / "manifest.json").read_text()) for i in range(meta["stages"])]
    except (OSError, ValueError, KeyError):
        return None
    for i, m in enumerate(mans):
        for fname, info in m["files"].items():
            f = d / f"stage_{i}" / fname
            if not f.is_file() or f.stat().st_size != info["size"]:
                return None
    return ExportResult(d, mans)


def cached_export(model: LocalModel, ranges: list[tuple[int, int]], opts: ExportOptions) -> ExportResult | None:
    """The complete export of this split at its default place, if one is there (no export needed)."""
    have = load_export(default_export_dir(model, ranges, opts))
    return have if have is not None and _matches(have, model, ranges, opts) else None


def export_model(
    model: LocalModel,
    ranges: list[tuple[int, int]],
    opts: ExportOptions,
    out_dir: Path | None = None,
    *,
    isolate: bool = True,
    quiet: bool = False,
    force: bool = False,
    progress: ExportProgress | None = None,
) -> ExportResult:
    """Export ``model`` cut at ``ranges`` (or reuse the export already there). ``progress``, when
    given, hears each stage begin, each phase of its export, and its end (from this thread)."""
    if opts.genai and len(ranges) != 1:
        raise ExportError("the GenAI-compatible export is a single whole-model IR: use one stage")
    if ranges[0][0] != 0 or ranges[-1][1] != model.num_layers:
        raise ExportError(f"stages must cover layers 0..{model.num_layers}")
    out = Path(out_dir) if out_dir else default_export_dir(model, ranges, opts)
    if not force:
        have = load_export(out)
        if have is not None and _matches(have, model, ranges, opts):
            step(f"reusing export {out}", not quiet)
            return have
    if out.exists() and any(out.iterdir()) and not (out / "export.json").exists():
        raise ExportError(f"{out} exists and is not a lakeshard export; choose an empty or new --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent))
    try:
        manifests = []
        t0 = time.monotonic()
        for i, (a, b) in enumerate(ranges):
            spec = StageSpec(i, len(ranges), a, b)
            step(f"stage {i + 1}/{len(ranges)}: layers {a}..{b - 1}, {opts.weights} weights", not quiet)
            sdir = tmp / f"stage_{i}"
            job = {"checkpoint": str(model.checkpoint), "config_dir": str(model.dir), "spec": asdict(spec)}
            job |= {"opts": asdict(opts), "dest": str(sdir), "model": _model_info(model)}
            on_phase = None
            if progress is not None:
                progress(i, len(ranges), 0.0, None)
                on_phase = _phase_reporter(progress, i, len(ranges))
            manifests.append(_run_stage_job(job, isolate, quiet, on_phase))
            if progress is not None:
                progress(i, len(ranges), 1.0, None)
        _copy_sidecars(model, tmp, opts, quiet)
        meta = {
            "export_version": EXPORT_VERSION,
            "model": _model_info(model),
            "stages": len(ranges),
            "ranges": ranges,
            "options": asdict(opts),
            "export_seconds": round(time.monotonic() - t0, 1),
            "peak_rss_mb": max(m["export_peak_rss_mb"] for m in manifests),
        }
        (tmp / "export.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = load_export(out)
    assert res is not None
    return res


def _matches(have: ExportResult, model: LocalModel, ranges: list[tuple[int, int]], opts: ExportOptions) -> bool:
    meta = json.loads((have.dir / "export.json").read_text())
    return (
        meta.get("export_version") == EXPORT_VERSION
        and meta["model"]["sha256"] == model.sha256
        and [tuple(r) for r in meta["ranges"]] == [tuple(r) for r in ranges]
        and meta["options"] == asdict(opts)
    )


ABANDONED_S = 6 * 3600  # an unfinished export untouched this long was left by a process that ended


def _remove_abandoned(folder: Path) -> None:
    """Delete unfinished exports (``.export-*``) left by a process that exited mid-export."""
    now = time.time()
    for d in folder.glob(".export-*"):
        try:
            if now - d.stat().st_mtime > ABANDONED_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


def _model_info(model: LocalModel) -> dict[str, Any]:
    return {
        "name": model.name,
        "sha256": model.sha256,
        "model_type": model.model_type,
        "layers": model.num_layers,
    }


def _phase_reporter(progress: ExportProgress, i: int, n: int) -> Callable[[str], None]:
    """The worker's announced phases (``PHASES``) as progress through stage ``i``; never back
    (the head part's weights are compressed after the layers' are saved: that is part of it)."""
    done = [0.0]

    def on_phase(line: str) -> None:
        for prefix, share in PHASES:
            if line.startswith(prefix):
                if share > done[0]:
                    done[0] = share
                    progress(i, n, share, prefix)
                return

    return on_phase


def _run_stage_job(
    job: dict[str, Any], isolate: bool, quiet: bool, on_phase: Callable[[str], None] | None = None
) -> dict[str, Any]:
    if not isolate:
        return export_stage(job)
    cmd = [sys.executable, "-m", "agent.export.worker"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",  # (a netns or a service may run with an ASCII locale; the worker prints UTF-8)
        errors="replace",
        env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONIOENCODING": "utf-8"},
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    stdout = proc.stdout
    drain = threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)  # (never a full pipe)
    drain.start()
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    tail: deque[str] = deque(maxlen=400)
    for raw in proc.stderr:  # the worker's phases, as they come
        line = raw.rstrip("\n")
        tail.append(line)
        if line.startswith("  "):
            if not quiet:
                sys.stderr.write(line + "\n")
            if on_phase is not None:
                on_phase(line.strip())
    proc.wait()
    drain.join()
    if proc.returncode != 0:
        lines = [ln for ln in tail if ln.strip()]
        err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
        spec = job["spec"]  # (counted from 1, as the progress shown while it runs)
        raise ExportError(f"exporting stage {spec['index'] + 1} of {spec['count']} failed: {err}")
    result: dict[str, Any] = json.loads("".join(out).strip().splitlines()[-1])
    return result


def _copy_sidecars(model: LocalModel, out: Path, opts: ExportOptions, quiet: bool) -> None:
    if model.tokenizer_dir.is_dir():
        shutil.copytree(model.tokenizer_dir, out / "tokenizer")
    shutil.copy2(model.dir / "config.json", out / "config.json")
    if not opts.genai:
        return
    # openvino_genai.LLMPipeline layout: openvino_model.xml, tokenizer IRs, configs.
    step("converting the tokenizer for OpenVINO GenAI", not quiet)
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer, GenerationConfig

    for ext in ("xml", "bin"):
        os.symlink(f"stage_0/model.{ext}", out / f"openvino_model.{ext}")
    hf_tok = AutoTokenizer.from_pretrained(str(model.tokenizer_dir))
    tok, detok = convert_tokenizer(hf_tok, with_detokenizer=True)
    ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
    ov.save_model(detok, str(out / "openvino_detokenizer.xml"))
    for f in (model.tokenizer_dir).iterdir():
        shutil.copy2(f, out / f.name)
    cfg = model.config()
    eos = cfg.eos_token_id
    gen = GenerationConfig(eos_token_id=eos, bos_token_id=cfg.bos_token_id, do_sample=False)  # type: ignore[no-untyped-call]
    gen.save_pretrained(str(out))


# ---- runs inside the worker process -------------------------------------------------------


def export_stage(job: dict[str, Any]) -> dict[str, Any]:
    """Export one stage; returns its manifest. Reads only this stage's tensors."""
    import gc

    import openvino as ov
    from transformers import AutoConfig

    from agent.export.ir import convert_head, convert_stage
    from agent.export.stage_module import HeadPart, StageModule, head_rows
    from agent.models.checkpoint import GGUFCheckpoint, opened

    spec = StageSpec(**job["spec"])
    opts = ExportOptions(**job["opts"])
    dest = Path(job["dest"])
    dest.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(job["config_dir"])
    t0 = time.monotonic()
    with opened(Path(job["checkpoint"]), cfg) as ckpt:
        factors = None
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if isinstance(ckpt, GGUFCheckpoint) and rope_type == "default":
            factors = ckpt.rope_freq_factors()
        _say("reading tensors")
        module = StageModule(cfg, ckpt, spec, full_logits=opts.genai, freq_factors=factors)
        rows = None if opts.genai else head_rows(cfg.vocab_size, spec.index, spec.count, HEAD_SHARE)
        head = HeadPart(cfg, ckpt, rows) if rows else None
    _say("converting to OpenVINO")
    model = convert_stage(module, cfg, beam_idx=opts.beam_idx)
    del module
    gc.collect()
    compression = _compress(model, opts)
    _say("saving")
    ov.save_model(model, str(dest / "model.xml"), compress_to_fp16=opts.weights == "fp16")
    inputs = [_port(p) for p in model.inputs]
    outputs = [_port(p) for p in model.outputs]
    del model
    gc.collect()
    files = ["model.xml", "model.bin"]
    if head is not None:
        _say(f"converting the head part (vocabulary rows {rows[0]}..{rows[1] - 1})")  # type: ignore[index]
        hmodel = convert_head(head, cfg)
        del head
        _compress(hmodel, opts)
        ov.save_model(hmodel, str(dest / "head.xml"), compress_to_fp16=opts.weights == "fp16")
        del hmodel
        gc.collect()
        files += HEAD_FILES
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    manifest = {
        "export_version": EXPORT_VERSION,
        "model": job["model"],
        "stage": {
            "index": spec.index,
            "count": spec.count,
            "layer_start": spec.layer_start,
            "layer_end": spec.layer_end,
            "first": spec.first,
            "last": spec.last,
        },
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": hd,
        "activation_dtype": "f32",
        "inputs": inputs,
        "outputs": outputs,
        "compression": compression,
        "beam_idx": opts.beam_idx,
        "full_logits": opts.genai,
        "runtime": {"kv_cache_precision": "f16"},
        "head_part": None if rows is None else {"rows": list(rows), "files": list(HEAD_FILES)},
        "files": {f: {"sha256": sha256_file(dest / f), "size": (dest / f).stat().st_size} for f in files},
        "export_seconds": round(time.monotonic() - t0, 1),
        "export_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "created": time.time(),
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def _say(msg: str) -> None:
    sys.stderr.write(f"  {msg}\n")
    sys.stderr.flush()


def _port(p: Any) -> dict[str, Any]:
    return {
        "name": p.get_any_name(),
        "dtype": p.get_element_type().get_type_name(),
        "shape": str(p.get_partial_shape()),
    }


def _compress(model: Any, opts: ExportOptions) -> dict[str, Any]:
    if opts.weights in ("fp32", "fp16"):
        return {"weights": opts.weights}
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

    _say(f"compressing weights to {opts.weights} (NNCF)")
    if opts.weights == "int8":
        nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        return {"weights": "int8", "mode": "int8_asym", "per_channel": True}
    # INT4 sym over all layers (embeddings and lm_head too): every stage is compressed by the
    # same rule, so a split equals the whole model. ADJUST lets hidden sizes that are not a
    # multiple of the group (SmolLM2's 576 with group 128) fall back to a smaller group.
    nncf.compress_weights(
        model,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        ratio=1.0,
        group_size=opts.group_size,
        all_layers=True,
        advanced_parameters=AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST),
    )
    return {"weights": "int4", "mode": "int4_sym", "group_size": opts.group_size, "all_layers": True}
