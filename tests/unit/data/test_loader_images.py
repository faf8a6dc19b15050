import base64
import io
import json

import pytest
from PIL import Image

from flashreinforce.data.loaders import count_placeholders, load_prompts


def _encoded(size=(8, 6), colour=(200, 30, 30), fmt="PNG", mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour).save(buffer, format=fmt)
    return buffer.getvalue()


def _size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.size


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RED, BLUE = _encoded(), _encoded(colour=(0, 0, 255))


def test_verl_geometry3k_parquet_loads_with_its_image_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "hiyouga/geometry3k",
             "prompt": [{"role": "user", "content": f"<image>Find x in triangle {i}. Think step by step."}],
             "images": [{"bytes": image, "path": None}],
             "ability": "math",
             "reward_model": {"ground_truth": str(3 + i), "style": "rule"},
             "extra_info": {"index": i, "split": "train"}}
            for i, image in enumerate((RED, BLUE))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "geo.parquet")
    prompts, skipped = load_prompts(tmp_path / "geo.parquet")
    assert skipped == []
    assert [p.id for p in prompts] == ["geo/0", "geo/1"]
    assert [p.images for p in prompts] == [(RED,), (BLUE,)]  # the bytes as stored, not re-encoded
    assert prompts[0].prompt == ({"role": "user", "content": "<image>Find x in triangle 0. Think step by step."},)
    assert prompts[1].ground_truth == "4" and prompts[1].data_source == "hiyouga/geometry3k"
    assert {p.modality for p in prompts} == {"image"}


def test_jsonl_base64_path_and_content_parts(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "blue.png").write_bytes(BLUE)
    jpeg = _encoded(fmt="JPEG")
    (tmp_path / "photo.jpg").write_bytes(jpeg)
    rows = [
        {"prompt": "<image>What colour?", "ground_truth": "red",
         "images": [{"bytes": base64.b64encode(RED).decode()}]},
        {"prompt": "<image> vs <image>: same?", "ground_truth": "no",
         "images": [{"path": "pics/blue.png", "bytes": None}, "photo.jpg"]},
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
         "ground_truth": "blue", "images": [str(tmp_path / "pics" / "blue.png")], "modality": "diagram"},
        {"prompt": "What is 2+2?", "ground_truth": "4", "images": []},
        {"prompt": "<image>Which?", "ground_truth": "red",
         "images": [{"bytes": "data:image/png;base64," + base64.b64encode(RED).decode()}]},
    ]
    prompts, _ = load_prompts(_jsonl(tmp_path / "d.jsonl", rows))
    assert [p.images for p in prompts] == [(RED,), (BLUE, jpeg), (BLUE,), (), (RED,)]
    # List contents become strings, an <image> in place of each image part: downstream reads strings only.
    assert prompts[2].prompt == ({"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "<image>What colour?"})
    assert [p.modality for p in prompts] == ["image", "image", "diagram", "text", "image"]


def test_the_same_text_with_two_images_gives_two_prompts(tmp_path):
    rows = [{"prompt": "<image>What colour?", "ground_truth": answer, "images": [{"bytes": base64.b64encode(image)
                                                                                   .decode()}]}
            for image, answer in ((RED, "red"), (BLUE, "blue"))]
    first, second = load_prompts(_jsonl(tmp_path / "d.jsonl", rows)).prompts
    assert first.prompt == second.prompt
    assert first.id != second.id and first.images != second.images


GOOD = {"prompt": "<image>ok?", "ground_truth": "yes", "images": [{"bytes": base64.b64encode(RED).decode()}]}


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "<image>What colour?", "ground_truth": "red"},
     r"prompt has 1 <image> placeholder but 0 images: attach its image"),
    ({"prompt": [{"role": "user", "content": "<image>What colour?"}], "ground_truth": "red", "images": []},
     r"prompt has 1 <image> placeholder but 0 images"),
    ({"prompt": "Same colour?", "ground_truth": "no", "images": ["a.png", "a.png"]},
     r"prompt has 0 <image> placeholders but 2 images: put one <image> in the text"),
    ({"prompt": "<image> and <image>?", "ground_truth": "no", "images": ["a.png", "a.png", "a.png"]},
     r"prompt has 2 <image> placeholders but 3 images"),
    ({"prompt": "<image><image>?", "ground_truth": "no",
      "images": ["a.png", {"bytes": base64.b64encode(b"not an image").decode()}]},
     r"images\[1\]: 12 bytes that do not decode as an image"),
    ({"prompt": "<image>?", "ground_truth": "no", "images": [{"bytes": "@@not base64@@"}]},
     r"images\[0\]\.bytes: a string that is not base64"),
    ({"prompt": "<image>?", "ground_truth": "no", "images": ["missing.png"]},
     r"images\[0\]: cannot read .*missing\.png .*relative paths start at the data's directory"),
    ({"prompt": "<image>?", "ground_truth": "no", "images": [{"bytes": None, "path": None}]},
     r"images\[0\]: \{'bytes': None, 'path': None\}; use"),
    ({"prompt": "<image>?", "ground_truth": "no", "images": {"bytes": "x"}},
     r"images: a dict; use a list"),
    ({"prompt": [{"role": "user", "content": [{"type": "video"}]}], "ground_truth": "no"},
     r"prompt\[0\]\.content\[0\]: \{'type': 'video'\}; use"),
    ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], "ground_truth": "no",
      "images": ["a.png"]},
     r"prompt\[0\]\.content\[0\]: keys \['image'\] would be dropped"),
])
def test_bad_image_rows_name_the_row_and_skip(tmp_path, row, message):
    (tmp_path / "a.png").write_bytes(RED)
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, row, GOOD])
    with pytest.raises(ValueError, match=rf"d\.jsonl line 2 \(row 1\): {message}.*on_bad_row='skip'"):
        load_prompts(path)
    prompts, skipped = load_prompts(path, on_bad_row="skip")
    assert [p.id for p in prompts] == ["d/0", "d/2"] and len(skipped) == 1
    assert skipped[0].startswith(f"{path} line 2 (row 1): ")


def test_undecodable_parquet_bytes_name_the_row_and_image(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    truncated = RED[: len(RED) // 2]
    rows = [{"prompt": "<image>a", "ground_truth": "1", "images": [{"bytes": RED, "path": None}]},
            {"prompt": "<image>b", "ground_truth": "2", "images": [{"bytes": truncated, "path": None}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "g.parquet")
    with pytest.raises(ValueError, match=r"g\.parquet row 1: images\[0\]: \d+ bytes that do not decode"):
        load_prompts(tmp_path / "g.parquet")
    assert [p.id for p in load_prompts(tmp_path / "g.parquet", on_bad_row="skip").prompts] == ["g/0"]


def test_max_pixels_downscales_large_images_only(tmp_path):
    large, small = _encoded((200, 100)), _encoded((40, 30), fmt="JPEG")
    grey = _encoded((90, 90), colour=128, mode="L")
    rows = [{"prompt": "<image><image><image>", "ground_truth": "x",
             "images": [{"bytes": base64.b64encode(image).decode()} for image in (large, small, grey)]}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    (resized, kept, grey_resized), = [p.images for p in load_prompts(path, max_pixels=5000).prompts]
    assert _size(resized) == (100, 50) and resized.startswith(b"\x89PNG")  # aspect kept, re-encoded as PNG
    assert kept == small  # under the limit: the bytes as they were, still JPEG
    assert _size(grey_resized) == (70, 70)
    with Image.open(io.BytesIO(resized)) as image:
        assert image.convert("RGB").getpixel((50, 25)) == (200, 30, 30)
    assert load_prompts(path).prompts[0].images == (large, small, grey)  # no limit: nothing re-encoded
    with pytest.raises(ValueError, match="max_pixels=0: use an int >= 1"):
        load_prompts(path, max_pixels=0)


def test_count_placeholders():
    assert count_placeholders("<image>a<image>b") == 2
    assert count_placeholders("no images") == 0
    assert count_placeholders(({"role": "system", "content": "<image>"},
                               {"role": "user", "content": "x <image> y <image>"})) == 3
    parts = [{"type": "image"}, {"type": "text", "text": "and <image>"}, {"type": "image", "text": None}]
    assert count_placeholders([{"role": "user", "content": parts}]) == 3
