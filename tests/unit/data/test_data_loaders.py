import json
import logging

import pytest

from flashreinforce.data.arithmetic import make_arithmetic_splits
from flashreinforce.data.loaders import load_prompts
from flashreinforce.types import Prompt

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
ROWS = [
    {"prompt": CHAT, "reward_model": {"ground_truth": "5", "style": "rule"}, "data_source": "toy",
     "extra_info": {"index": 7, "reference_think": "2+3=5"}, "ability": "math"},
    {"prompt": "What is 4+4?", "ground_truth": 8, "difficulty": 2, "id": "custom-id"},
]
EXPECTED = [
    Prompt(id="toy/7", prompt=tuple(CHAT), ground_truth="5", data_source="toy", reference_think="2+3=5"),
    Prompt(id="custom-id", prompt="What is 4+4?", ground_truth="8", difficulty=2.0),
]


def _jsonl(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_common_format(tmp_path):
    path = _jsonl(tmp_path / "toy.jsonl", [ROWS[0], "\n", ROWS[1], {"prompt": "Hi?", "ground_truth": "x"}])
    prompts, skipped = load_prompts(path)
    # Blank lines are not rows: the third row is row 2, and its id comes from the file stem.
    assert prompts == [*EXPECTED, Prompt(id="toy/2", prompt="Hi?", ground_truth="x")]
    assert skipped == []


def test_parquet_and_saved_datasets(tmp_path):
    import dataclasses

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A table has one schema: every row has every column (None where absent) and both prompts are chat.
    # Arrow also fills message keys with None, which the loader must not count as extra keys.
    rows = [{**ROWS[0], "prompt": [{**m, "name": None} for m in CHAT]},
            {**ROWS[1], "prompt": [{"role": "user", "content": "What is 4+4?", "name": None}]}]
    rows = [{key: row.get(key) for key in {*rows[0], *rows[1]}} for row in rows]
    expected = [EXPECTED[0], dataclasses.replace(EXPECTED[1], prompt=({"role": "user", "content": "What is 4+4?"},))]
    datasets.disable_progress_bars()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "toy.parquet")
    assert load_prompts(tmp_path / "toy.parquet").prompts == expected

    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(tmp_path / "single"))
    # The directory name is the stem of derived ids (with the split when there are splits).
    assert load_prompts(tmp_path / "single").prompts == [dataclasses.replace(expected[0], id="single/7"), expected[1]]
    datasets.DatasetDict(train=dataset, test=dataset.select([0])).save_to_disk(str(tmp_path / "splits"))
    assert load_prompts(tmp_path / "splits", split="test").prompts == [
        dataclasses.replace(expected[0], id="splits/test/7")]
    with pytest.raises(ValueError, match=r"holds splits \['test', 'train'\]: choose one"):
        load_prompts(tmp_path / "splits")
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_prompts(tmp_path / "splits", split="dev")
    with pytest.raises(ValueError, match="single Dataset with no splits"):
        load_prompts(tmp_path / "single", split="train")


def test_arithmetic_items_round_trip_through_jsonl(tmp_path):
    train, _ = make_arithmetic_splits(20, 0, seed=0)
    rows = [{"id": p.id, "prompt": p.prompt, "reward_model": {"ground_truth": p.ground_truth},
             "data_source": p.data_source, "reference_think": p.reference_think, "difficulty": p.difficulty}
            for p in train]
    assert load_prompts(_jsonl(tmp_path / "a.jsonl", rows)).prompts == train


@pytest.mark.parametrize(("row", "field"), [
    ({"prompt": "2+2?"}, r"reward_model.ground_truth: missing"),
    ({"prompt": "2+2?", "answer": "#### 4"}, r"reward_model.ground_truth: missing.*map it to ground_truth"),
    ({"prompt": "2+2?", "ground_truth": ["4", "four"]}, r"reward_model.ground_truth: a list"),
    ({"prompt": "2+2?", "ground_truth": True}, r"reward_model.ground_truth: a bool"),
    ({"prompt": "2+2?", "ground_truth": "  "}, r"reward_model.ground_truth: empty"),
    ({"prompt": "2+2?", "reward_model": {"ground_truth": "4"}, "ground_truth": "5"},
     r"reward_model.ground_truth: ambiguous"),
    ({"prompt": "   ", "ground_truth": "4"}, r"prompt: empty string"),
    ({"prompt": [], "ground_truth": "4"}, r"prompt: missing or empty"),
    ({"ground_truth": "4"}, r"prompt: missing or empty"),
    ({"prompt": {"role": "user"}, "ground_truth": "4"}, r"prompt: a dict"),
    ({"prompt": [{"content": "2+2?"}], "ground_truth": "4"}, r"prompt\[0\]: needs a non-empty string 'role'"),
    ({"prompt": [{"role": "user", "content": "2+2?", "name": "bob"}], "ground_truth": "4"},
     r"prompt\[0\]: keys \['name'\]"),
    ({"prompt": [{"role": "user", "content": ""}], "ground_truth": "4"}, r"prompt: every message is empty"),
    ({"prompt": "2+2?", "ground_truth": "4", "reward_model": "4"}, r"reward_model: a str"),
    ({"prompt": "2+2?", "ground_truth": "4", "data_source": 3}, r"data_source: 3"),
    ({"prompt": "2+2?", "ground_truth": "4", "difficulty": "hard"}, r"difficulty: 'hard'"),
    ({"prompt": "2+2?", "ground_truth": "4", "reference_think": 12}, r"reference_think: a int"),
    ("[1, 2]", r"row is a list"),
    ('{"prompt": "2+2?", "ground_truth": "4"', r"malformed JSON"),
])
def test_bad_row_names_file_row_and_field(tmp_path, row, field):
    good = {"prompt": "1+1?", "ground_truth": "2"}
    line = row + "\n" if isinstance(row, str) else json.dumps(row) + "\n"
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + line)
    with pytest.raises(ValueError, match=rf"d\.jsonl line 3 \(row 1\): {field}.*on_bad_row='skip'"):
        load_prompts(path)
    prompts, skipped = load_prompts(path, on_bad_row="skip")
    assert [p.ground_truth for p in prompts] == ["2"] and len(skipped) == 1
    assert skipped[0].startswith(f"{path} line 3 (row 1):")


def test_duplicate_ids_are_bad_rows(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"id": 1, "prompt": "a", "ground_truth": "1"},
                                         {"id": "1", "prompt": "b", "ground_truth": "2"}])
    with pytest.raises(ValueError, match=r"row 1\): id: '1' already used by .*line 1 \(row 0\)"):
        load_prompts(path)


def test_skip_counts_and_logs_every_bad_row(tmp_path, caplog):
    rows = [{"prompt": "a", "ground_truth": "1"}, {"prompt": "b"}, "not json\n", {"prompt": "c", "ground_truth": "3"}]
    with caplog.at_level(logging.WARNING):
        prompts, skipped = load_prompts(_jsonl(tmp_path / "d.jsonl", rows), on_bad_row="skip")
    assert [p.id for p in prompts] == ["d/0", "d/3"]
    assert len(skipped) == 2 and "row 1" in skipped[0] and "row 2" in skipped[1]
    assert "skipped 2 bad rows" in caplog.text
    with pytest.raises(ValueError, match="all 2 rows are bad"):
        load_prompts(_jsonl(tmp_path / "bad.jsonl", rows[1:3]), on_bad_row="skip")


def test_bad_paths_and_arguments(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("prompt,ground_truth\n")
    with pytest.raises(ValueError, match="use a .jsonl or .parquet file"):
        load_prompts(tmp_path / "d.csv")
    with pytest.raises(ValueError, match="not a datasets.save_to_disk output"):
        load_prompts(tmp_path)
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "ground_truth": "1"}])
    with pytest.raises(ValueError, match="one file, drop split"):
        load_prompts(path, split="train")
    with pytest.raises(ValueError, match="on_bad_row='warn'"):
        load_prompts(path, on_bad_row="warn")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="it has no rows"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_prompts(tmp_path / "fake.parquet")


@pytest.mark.parametrize("compression", ["none", "snappy"])
def test_parquet_with_damaged_pages_names_the_file_and_rows(tmp_path, compression):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "damaged.parquet"
    rows = [{"prompt": f"What is {i}+{i}?", "ground_truth": str(2 * i)} for i in range(300)]
    pq.write_table(pa.Table.from_pylist(rows), path, compression=compression, row_group_size=100,
                   use_dictionary=False)
    group = pq.ParquetFile(path).metadata.row_group(1)
    columns = [group.column(c) for c in range(group.num_columns)]
    start = min(c.data_page_offset for c in columns)
    end = max(c.data_page_offset + c.total_compressed_size for c in columns)
    data = bytearray(path.read_bytes())
    data[start:end] = b"\xff" * (end - start)  # the pages of row group 1; the footer is left intact
    path.write_bytes(bytes(data))
    assert pq.ParquetFile(path).metadata.num_rows == 300, "the footer must still open"
    for on_bad_row in ("error", "skip"):  # a lost page is not one bad row: an error either way
        with pytest.raises(ValueError, match=r"damaged\.parquet: rows 100-199 \(row group 1\) are unreadable.*"
                                             r"re-export"):
            load_prompts(path, on_bad_row=on_bad_row)
