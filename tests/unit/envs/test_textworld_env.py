"""TextWorld / ALFWorld adapters on games TextWorld generates here (`.ci/textworld` runs these in its own venv)."""

import dataclasses
import json
from pathlib import Path

import pytest

from flashreinforce.envs.protocol import EnvSpec, build_env
from flashreinforce.envs.textworld_env import (
    ALFWORLD_TASK_MARKER,
    ALFWorldEnv,
    TextWorldEnv,
    TextWorldSession,
    alfworld_prompts,
    alfworld_settings,
    clean_feedback,
    generate_textworld_games,
    split_task,
)
from flashreinforce.types import Prompt

textworld = pytest.importorskip("textworld")

# A two-receptacle ALFWorld problem in the downloaded data's format (object names as ALFRED mangles them).
BOOK, BOX = "Book_bar__minus_01_dot_00_bar__plus_00_dot_50", "Box_bar__minus_02_dot_00_bar__plus_00_dot_50"
CHAIR, SOFA = "ArmChair_bar__minus_01_dot_00_bar__plus_00_dot_00", "Sofa_bar__minus_02_dot_00_bar__plus_00_dot_00"
ALFWORLD_PROBLEM = f"""(define (problem plan_trial_test) (:domain alfred)
(:objects agent1 - agent BoxType BookType - otype SofaType ArmChairType - rtype {BOOK} {BOX} - object
  {CHAIR} {SOFA} - receptacle loc1 loc3 loc5 - location)
(:init (receptacleType {CHAIR} ArmChairType) (receptacleType {SOFA} SofaType) (objectType {BOX} BoxType)
  (objectType {BOOK} BookType) (canContain SofaType BoxType) (canContain SofaType BookType)
  (canContain ArmChairType BookType) (pickupable {BOX}) (pickupable {BOOK}) (atLocation agent1 loc1)
  (inReceptacle {BOOK} {CHAIR}) (inReceptacle {BOX} {SOFA}) (receptacleAtLocation {CHAIR} loc5)
  (receptacleAtLocation {SOFA} loc3) (objectAtLocation {BOX} loc3) (objectAtLocation {BOOK} loc5))
(:goal (and (exists (?r - receptacle) (exists (?o - object)
  (and (inReceptacle ?o ?r) (objectType ?o BookType) (receptacleType ?r SofaType)))))))"""

pytestmark = [pytest.mark.textworld, pytest.mark.filterwarnings("ignore:Unable to find valid actions")]


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tw_games")
    return directory, generate_textworld_games(directory, 2, seed=0)


def walkthrough(directory, prompt):
    return textworld.Game.load(str(directory / prompt.ground_truth).replace(".z8", ".json")).walkthrough


def commands_line(observation):
    return next(line for line in observation.splitlines() if line.startswith("Admissible commands: "))


def test_generated_games_are_deterministic_files_reused_on_a_second_call(games):
    directory, prompts = games
    assert len({p.ground_truth for p in prompts}) == 2
    files = [directory / p.ground_truth for p in prompts]
    stamps = [f.stat().st_mtime_ns for f in files]
    assert generate_textworld_games(directory, 2, seed=0) == prompts
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert all(p.data_source == "textworld" and p.difficulty == 2.0 for p in prompts)


def test_the_walkthrough_wins_with_score_difference_rewards_and_a_success_flag(games):
    directory, prompts = games
    env = build_env(EnvSpec("textworld", {"game_dir": str(directory)}))
    for prompt in prompts:
        first = env.reset(prompt, seed=0)
        assert first.startswith("Task: ") and "$$" not in first and "\n>" not in first
        steps = walkthrough(directory, prompt)
        results = [env.step(command) for command in steps]
        assert [r.done for r in results] == [False] * (len(steps) - 1) + [True]
        assert [r.info["success"] for r in results] == [False] * (len(steps) - 1) + [True]
        assert sum(r.reward for r in results) == results[-1].info["score"] > 0
        assert "RESTART" not in results[-1].observation and "Admissible" not in results[-1].observation


def test_the_observation_is_cleaned_and_offers_exactly_the_admissible_commands(games):
    directory, prompts = games
    path = str(directory / prompts[0].ground_truth)
    infos = textworld.EnvInfos(admissible_commands=True, objective=True)
    raw = textworld.start(path, request_infos=infos).reset()
    assert "$$" in raw.feedback  # the banner to strip
    cleaned = clean_feedback(raw.feedback, objective=raw.objective)
    assert "$$" not in cleaned and raw.objective not in cleaned and cleaned.startswith("-= ")
    env = TextWorldEnv(game_dir=str(directory))
    first = env.reset(prompts[0], seed=0)
    assert first.splitlines()[0] == f"Task: {raw.objective}"
    assert commands_line(first) == f"Admissible commands: {', '.join(raw.admissible_commands)}."
    bad = env.step("dance wildly\ngo north")  # only the first line is a command
    assert bad.reward == 0.0 and not bad.done and "not a verb" in bad.observation
    assert not bad.observation.startswith("Task: ")  # without history, only the first observation has the task


def test_replaying_the_actions_into_a_fresh_env_reproduces_the_observations(games):
    directory, prompts = games
    actions = ["look", "inventory", *walkthrough(directory, prompts[1])]

    def episode(env):
        return [env.reset(prompts[1], seed=0), *(env.step(a).observation for a in actions)]

    first = episode(TextWorldEnv(game_dir=str(directory)))
    again = TextWorldEnv(game_dir=str(directory))
    assert episode(again) == first and episode(again) == first  # a fresh env, then a reset of the same one


def test_max_steps_ends_an_unwon_episode(games):
    directory, prompts = games
    env = TextWorldEnv(game_dir=str(directory), max_steps=2)
    env.reset(prompts[0], seed=0)
    assert not env.step("look").done
    last = env.step("look")
    assert last.done and last.reward == 0.0 and last.info["success"] is False
    with pytest.raises(AssertionError, match="reset"):
        env.step("look")


def test_a_history_window_carries_the_task_and_the_last_k_steps(games):
    directory, prompts = games
    env = TextWorldEnv(game_dir=str(directory), history=1)
    task = env.reset(prompts[0], seed=0).splitlines()[0]
    env.step("inventory")
    observation = env.step("look").observation
    assert observation.startswith(task + "\nYour last 1 of 2 steps:\n")
    assert "Action: look\nStep 3. Current observation: -= " in observation
    assert "Action: inventory" not in observation  # older than the window
    assert commands_line(observation)


def test_alfworld_settings_on_a_textworld_game_pay_ten_on_the_win_and_keep_two_steps(games):
    directory, prompts = games
    # TextWorld games state no "Your task is to:", so the task comes from their objective here.
    session = TextWorldSession(dataclasses.replace(alfworld_settings(), task_marker=""))
    assert session.settings.max_steps == 50 and session.settings.history == 2
    session.reset(str(directory / prompts[0].ground_truth))
    steps = ["look", *walkthrough(directory, prompts[0])]
    results = [session.step(command) for command in steps]
    assert [r.reward for r in results] == [0.0] * (len(steps) - 1) + [10.0]
    assert results[-1].info["success"] and results[-1].done
    assert results[-1].observation.count("Action: ") == 2


def test_status_lines_and_the_restart_question_are_stripped():
    # As TextWorld prints them when more infos are requested (moves, description, ...).
    raw = ("\nYou close the cuboid locker.\n\n\nYour score has just gone up by one point.\n\n\n"
           "                                                       *** The End ***\n\n"
           "You scored 1 out of a possible 1, in 3 turns.\n\n\n"
           "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?\n"
           ">                                                                 -= Studio =-0/2")
    assert clean_feedback(raw) == ("You close the cuboid locker.\n\nYour score has just gone up by one point.\n\n"
                                   "*** The End ***\n\nYou scored 1 out of a possible 1, in 3 turns.")


def test_alfworld_text_handling_finds_the_task_and_drops_the_welcome():
    feedback = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. You see a cabinet 1.\n\n"
                f"{ALFWORLD_TASK_MARKER}put a clean cloth in bathtubbasin.")
    cleaned = clean_feedback(feedback, drop_lines=alfworld_settings().drop_lines)
    task, rest = split_task(cleaned, ALFWORLD_TASK_MARKER)
    assert (task, rest) == ("put a clean cloth in bathtubbasin.", "You are in the middle of a room. You see a cabinet 1.")
    assert split_task("no task here", ALFWORLD_TASK_MARKER) == ("", "no task here")


def test_alfworld_without_its_data_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(ValueError, match="ALFWORLD_DATA is not set.*alfworld-download"):
        ALFWorldEnv()
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="does not exist.*alfworld-download"):
        build_env(EnvSpec("alfworld"))
    with pytest.raises(ValueError, match="no game.tw-pddl"):
        alfworld_prompts("train", data_dir=str(tmp_path))


def test_alfworld_prompts_list_solvable_games_relative_to_the_data_folder(tmp_path):
    for trial, solvable in (("pick_and_place_simple-Mug/trial_1", True), ("pick_and_place_simple-Mug/trial_2", False),
                            ("pick_and_place_simple-Apple-movable/trial_1", True)):
        game = tmp_path / "json_2.1.1" / "train" / trial / "game.tw-pddl"
        game.parent.mkdir(parents=True)
        game.write_text(json.dumps({"solvable": solvable}))
    prompts = alfworld_prompts("train", data_dir=str(tmp_path))
    assert [p.ground_truth for p in prompts] == ["json_2.1.1/train/pick_and_place_simple-Mug/trial_1/game.tw-pddl"]
    env = ALFWorldEnv(data_dir=str(tmp_path))
    try:
        import alfworld  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install alfworld"):
            env.reset(prompts[0], seed=0)
    with pytest.raises(ValueError, match="split='test'"):
        alfworld_prompts("test", data_dir=str(tmp_path))
    assert isinstance(prompts[0], Prompt)


def test_alfworld_env_plays_a_pddl_game_made_from_the_shipped_domain_and_grammar(tmp_path, monkeypatch):
    alfworld = pytest.importorskip("alfworld")  # the wheel ships the domain and grammar, not the games
    data = Path(alfworld.__file__).parent / "data"
    game = tmp_path / "json_2.1.1" / "valid_seen" / "pick_and_place_simple-Book-None-Sofa-1" / "trial_1" / "game.tw-pddl"
    game.parent.mkdir(parents=True)
    grammar = (data / "alfred.twl2").read_text().replace("UNKNOWN GOAL", "put some book on sofa")
    game.write_text(json.dumps({"pddl_domain": (data / "alfred.pddl").read_text(), "grammar": grammar,
                                "pddl_problem": ALFWORLD_PROBLEM, "solvable": True}))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    env = build_env(EnvSpec("alfworld"))
    prompt = alfworld_prompts("valid_seen")[0]
    first = env.reset(prompt, seed=0)
    assert first.startswith("Task: put some book on sofa.\nStep 1. Current observation: You are in the middle")
    assert "Welcome" not in first and "go to armchair 1" in commands_line(first)
    steps = ["go to armchair 1", "take book 1 from armchair 1", "go to sofa 1", "move book 1 to sofa 1"]
    results = [env.step(command) for command in steps]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 10.0] and results[-1].info["success"]
    assert results[2].observation.count("Action: ") == 2  # the last two steps
    assert env.reset(prompt, seed=0) == first
