"""Datasets in the common RL format (verl-style rows) -> list[Prompt].

Reads .jsonl, .parquet and `datasets.save_to_disk` directories. One row:

    {"prompt": [{"role": "user", "content": "<image>What is 2+3?"}],  # or a plain string
     "reward_model": {"ground_truth": "5"},                      # or a top-level "ground_truth"
     "data_source": "gsm8k",                                     # optional, default "default"
     "extra_info": {"index": 7, "reference_think": "2+3=5"},    # optional; also top-level "reference_think"
     "images": [{"bytes": <PNG bytes>, "path": None}],          # optional, one per <image> in the text
     "id": "gsm8k/7", "difficulty": 1, "modality": "image"}     # optional

Images (verl's geometry3k layout): each item of `images` is {"bytes": <encoded image>} (a "path" beside it is
ignored), {"path": "<file>"}, or a plain string path; relative paths start at the data file's directory (a
`save_to_disk` directory's own), and in .jsonl "bytes" may be a base64 string (or a data: URI). They become
`Prompt.images`, the bytes as read: only an image over `max_pixels` pixels is re-encoded (downscaled, PNG). A
message's content may also be a list of parts, [{"type": "image"}, {"type": "text", "text": "..."}]: it becomes a
string with `<image>` in place of each image part. The text's `<image>` placeholders (`count_placeholders`) must
number the images, and every image must decode; rows with images get modality "image" unless they set one.

Where two columns could hold one field, both may be given only if they agree. A top-level `answer`
column is never read as the ground truth: in GSM8K and its kin it is a worked solution, not the
final answer (map it to `ground_truth` yourself). Ids: `id`, else "<stem>/<extra_info.index>", else
"<stem>/<row>"; they must be unique within a file. Other columns are ignored. A bad row raises a
ValueError naming file, row and field, or with on_bad_row="skip" is skipped, logged and returned.
This module knows nothing about tokenizers or chat templates.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from flashreinforce.models.image_tokens import IMAGE_TOKEN
from flashreinforce.types import Prompt

log = logging.getLogger(__name__)

_BATCH_ROWS = 1024


class LoadedPrompts(NamedTuple):
    prompts: list[Prompt]
    skipped: list[str]
    """One message per skipped bad row ("<file> row 12: <field>: <problem>"); len() is the count."""


class _BadRow(Exception):
    """A row that breaks the format; the loader adds the file and row to the message."""


def load_prompts(
    path: str | Path,
    *,
    on_bad_row: Literal["error", "skip"] = "error",
    split: str | None = None,
    max_pixels: int | None = None,
) -> LoadedPrompts:
    """Every row of a .jsonl / .parquet file or a `save_to_disk` directory, as Prompts in file order.

    `split` picks one split of a saved DatasetDict (optional when it has only one). `max_pixels`: an image of
    more pixels (width x height) is downscaled to fit, keeping its aspect ratio, and re-encoded as PNG.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row={on_bad_row!r}: use 'error' or 'skip'")
    if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(max_pixels, int)
                                   or max_pixels < 1):
        raise ValueError(f"max_pixels={max_pixels!r}: use an int >= 1, or None to keep images as they are")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data path {path} does not exist (relative paths start at {Path.cwd()})")
    # Relative image paths start where the data is: the file's directory, or a saved dataset's own directory.
    base = path if path.is_dir() else path.parent
    if path.is_dir():
        rows, stem = _saved_dataset_rows(path, split)
    elif split is not None:
        raise ValueError(f"split={split!r} picks a split of a saved DatasetDict; {path} is one file, drop split")
    elif path.suffix == ".jsonl":
        rows, stem = _jsonl_rows(path), path.stem
    elif path.suffix == ".parquet":
        rows, stem = _parquet_rows(path), path.stem
    else:
        raise ValueError(f"data path {path}: use a .jsonl or .parquet file or a datasets.save_to_disk directory")

    prompts: list[Prompt] = []
    skipped: list[str] = []
    first_row_of_id: dict[str, str] = {}
    for index, where, row in rows:
        try:
            if isinstance(row, _BadRow):  # unreadable (bad JSON): the same skip-or-raise policy applies
                raise row
            prompt = _parse_row(row, default_id=f"{stem}/{index}", stem=stem, base=base, max_pixels=max_pixels)
            if prompt.id in first_row_of_id:
                raise _BadRow(f"id: {prompt.id!r} already used by {first_row_of_id[prompt.id]}; ids key the "
                              "exactly-once ledger, make them unique")
        except _BadRow as bad:
            message = f"{where}: {bad}"
            if on_bad_row == "error":
                raise ValueError(f"{message} (or set on_bad_row='skip' to skip and count bad rows)") from None
            skipped.append(message)
            continue
        first_row_of_id[prompt.id] = where
        prompts.append(prompt)

    if skipped:
        log.warning("%s: skipped %d bad rows; first: %s", path, len(skipped), skipped[0])
    if not prompts:
        detail = f"all {len(skipped)} rows are bad, first: {skipped[0]}" if skipped else "it has no rows"
        raise ValueError(f"data path {path} gives no prompts: {detail}")
    return LoadedPrompts(prompts, skipped)


# ---- readers: (row index, where, row dict or _BadRow) in file order ----

def _jsonl_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    row = 0
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():  # blank lines (a trailing newline, spacing) are not rows
                continue
            where = f"{path} line {line_number} (row {row})"
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                record = _BadRow(f"not UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8")
            except json.JSONDecodeError as e:
                record = _BadRow(f"malformed JSON ({e.msg} at column {e.colno}); fix or remove the line")
            yield row, where, record
            row += 1


def _parquet_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    import pyarrow
    import pyarrow.parquet as pq  # lazy: only parquet users pay for it

    try:
        parquet = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise ValueError(f"data path {path} is not a readable parquet file ({e}); check the file") from e
    return _parquet_records(path, parquet)


def _parquet_records(path: Path, parquet: Any) -> Iterator[tuple[int, str, Any]]:
    """Rows one row group at a time, so that damaged pages (the footer opened fine) are reported with the
    rows they hold. A whole page is lost, not one row, so this is an error even with on_bad_row='skip'."""
    import pyarrow

    first = 0
    for group in range(parquet.metadata.num_row_groups):
        count, row = parquet.metadata.row_group(group).num_rows, first
        try:
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group]):
                for record in batch.to_pylist():
                    yield row, f"{path} row {row}", record
                    row += 1
        except (pyarrow.ArrowException, OSError) as e:  # thrift page headers fail as a plain OSError
            raise ValueError(f"data path {path}: rows {row}-{first + count - 1} (row group {group}) are unreadable, "
                             f"the file is damaged ({' '.join(str(e).split())}); re-export or re-download it") from e
        first += count


def _saved_dataset_rows(path: Path, split: str | None) -> tuple[Iterator[tuple[int, str, Any]], str]:
    if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        raise ValueError(f"data path {path} is a directory but not a datasets.save_to_disk output (no "
                         "dataset_info.json / dataset_dict.json); point at a .jsonl/.parquet file or such a directory")
    import datasets  # lazy: a slow import that only saved-dataset users need

    loaded = datasets.load_from_disk(str(path))
    label, stem = str(path), path.name
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        if split is None and len(names) != 1:
            raise ValueError(f"{path} holds splits {names}: choose one with split=...")
        split = split if split is not None else names[0]
        if split not in loaded:
            raise ValueError(f"{path} has no split {split!r}; it holds {names}")
        loaded, label, stem = loaded[split], f"{path} [split {split}]", f"{path.name}/{split}"
    elif split is not None:
        raise ValueError(f"split={split!r} but {path} is a single Dataset with no splits; drop split")

    tables = loaded.with_format("arrow").iter(batch_size=_BATCH_ROWS)
    records = (record for table in tables for record in table.to_pylist())
    return ((row, f"{label} row {row}", record) for row, record in enumerate(records)), stem


# ---- one row -> Prompt ----

def _parse_row(row: Any, *, default_id: str, stem: str, base: Path, max_pixels: int | None) -> Prompt:
    if not isinstance(row, dict):
        raise _BadRow(f"row is a {type(row).__name__}; each row must be an object with prompt and ground_truth")
    extra = _object(row, "extra_info")
    reward_model = _object(row, "reward_model")

    ground_truth = _one_of(("reward_model.ground_truth", _get(reward_model, "ground_truth")),
                           ("ground_truth", row.get("ground_truth")))
    if ground_truth is None:
        hint = " (this row has an `answer` column: map it to ground_truth if it is the final answer)" \
            if row.get("answer") is not None else ""
        raise _BadRow(f"reward_model.ground_truth: missing; add the answer the verifier checks{hint}")
    reference_think = _one_of(("extra_info.reference_think", _get(extra, "reference_think")),
                              ("reference_think", row.get("reference_think")))

    if row.get("id") is not None:
        id_ = _text_or_int(row["id"], "id")
    elif _get(extra, "index") is not None:
        id_ = f"{stem}/{_text_or_int(extra['index'], 'extra_info.index')}"
    else:
        id_ = default_id

    prompt = _prompt(row.get("prompt"))
    images = _images(row.get("images"), base, max_pixels)
    _check_placeholders(prompt, len(images))
    return Prompt(
        id=id_,
        prompt=prompt,
        ground_truth=_ground_truth(ground_truth),
        data_source=_optional_str(row, "data_source") or "default",
        reference_think=None if reference_think is None else _string(reference_think, "reference_think"),
        modality=_optional_str(row, "modality") or ("image" if images else "text"),
        difficulty=_difficulty(row.get("difficulty")),
        images=images,
    )


def _prompt(value: Any) -> str | tuple[dict[str, str], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow("prompt: empty string; give the question text")
        return value
    if value is None or value == []:
        raise _BadRow("prompt: missing or empty; use a string or a list of {'role', 'content'} messages")
    if not isinstance(value, list):
        raise _BadRow(f"prompt: a {type(value).__name__}; use a string or a list of {{'role', 'content'}} messages")
    messages = []
    for k, message in enumerate(value):
        if not isinstance(message, dict):
            raise _BadRow(f"prompt[{k}]: a {type(message).__name__}; each message is {{'role': ..., 'content': ...}}")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list):
            content = _content_text(content, k)
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise _BadRow(f"prompt[{k}]: needs a non-empty string 'role' and a string 'content' (or a list of "
                          f"parts), got {message!r}")
        # Arrow gives every message every key any message has, filled with None: only a real value is extra.
        extra_keys = sorted(key for key, v in message.items() if key not in ("role", "content") and v is not None)
        if extra_keys:
            raise _BadRow(f"prompt[{k}]: keys {extra_keys} would be dropped; keep only role and content")
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        raise _BadRow("prompt: every message is empty; give the question text")
    return tuple(messages)


def _content_text(parts: list, k: int) -> str:
    """A message's list of parts as one string, IMAGE_TOKEN in place of each image part: downstream (chat
    templates, the placeholder expansion) reads string contents only."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            texts.append(IMAGE_TOKEN)
        elif kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise _BadRow(f"prompt[{k}].content[{j}]: {part!r}; use {{'type': 'image'}} or "
                          "{'type': 'text', 'text': '...'}")
        # Arrow fills absent keys with None; a real value elsewhere (an inline image) would be dropped.
        extra_keys = sorted(key for key, v in part.items() if key not in ("type", "text") and v is not None)
        if extra_keys:
            raise _BadRow(f"prompt[{k}].content[{j}]: keys {extra_keys} would be dropped; give images in the "
                          "`images` column and keep only type (and text) here")
    return "".join(texts)


def count_placeholders(prompt: str | Sequence[Mapping[str, Any]]) -> int:
    """How many images a prompt's text asks for: its IMAGE_TOKENs, in a plain string or summed over the chat
    messages' contents (a content given as a list of parts counts one per image part)."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_TOKEN)
    total = 0
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str):
            total += content.count(IMAGE_TOKEN)
        elif isinstance(content, list):
            total += sum(1 if part.get("type") == "image" else str(part.get("text") or "").count(IMAGE_TOKEN)
                         for part in content if isinstance(part, Mapping))
    return total


def _check_placeholders(prompt: str | tuple[dict[str, str], ...], images: int) -> None:
    placeholders = count_placeholders(prompt)
    if placeholders == images:
        return
    fix = (f"attach its image in the `images` column, or drop the {IMAGE_TOKEN} from the text" if not images else
           f"put one {IMAGE_TOKEN} in the text where each image goes")
    raise _BadRow(f"prompt has {_plural(placeholders, IMAGE_TOKEN + ' placeholder')} but "
                  f"{_plural(images, 'image')}: {fix}")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _images(value: Any, base: Path, max_pixels: int | None) -> tuple[bytes, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _BadRow(f"images: a {type(value).__name__}; use a list of {{'bytes': ...}}, {{'path': ...}} or paths")
    return tuple(_checked_image(_image_bytes(item, k, base), k, max_pixels) for k, item in enumerate(value))


def _image_bytes(item: Any, k: int, base: Path) -> bytes:
    """The encoded bytes of images[k]: given inline (raw, or base64 text from JSON) or read from its file."""
    data = item.get("bytes") if isinstance(item, dict) else None
    path = item.get("path") if isinstance(item, dict) else item
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        payload = data.partition(",")[2] if data.startswith("data:") else data  # a data: URI holds base64 too
        try:
            return base64.b64decode("".join(payload.split()), validate=True)  # wrapped lines are still base64
        except binascii.Error as e:
            raise _BadRow(f"images[{k}].bytes: a string that is not base64 ({e}); give base64 of the encoded "
                          "image") from None
    if data is not None or not isinstance(path, str) or not path:
        raise _BadRow(f"images[{k}]: {_short(item)}; use {{'bytes': <encoded image>}}, {{'path': '<file>'}} or a "
                      "path string")
    file = base / path
    try:
        return file.read_bytes()
    except OSError as e:
        where = "" if Path(path).is_absolute() else f" (relative paths start at the data's directory {base})"
        raise _BadRow(f"images[{k}]: cannot read {file} ({e.strerror or e}){where}; fix the path or add the "
                      "file") from None


def _checked_image(data: bytes, k: int, max_pixels: int | None) -> bytes:
    """`data` as it is when it decodes and fits max_pixels; downscaled and re-encoded as PNG when it is larger."""
    from PIL import Image, UnidentifiedImageError  # lazy: text-only data never needs it

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # the header alone opens; a truncated or corrupt body fails only here
            width, height = image.size
            if max_pixels is None or width * height <= max_pixels:
                return data
            size = _fit(width, height, max_pixels)
            # Filtering needs continuous channels (not a palette or 1-bit), and PNG has no CMYK: keep grey as grey
            # and transparency as alpha, everything else becomes RGB.
            mode = "RGBA" if image.has_transparency_data else "L" if image.mode in ("1", "L") else "RGB"
            resized = image.convert(mode).resize(size, Image.Resampling.LANCZOS)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise _BadRow(f"images[{k}]: {len(data)} bytes that do not decode as an image ({e}); fix or drop the "
                      "image") from None
    buffer = io.BytesIO()
    resized.save(buffer, format="PNG")
    return buffer.getvalue()


def _fit(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """The largest size of the same aspect ratio with at most max_pixels pixels (a side is at least 1 px)."""
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    # Floors keep w * h <= max_pixels unless a side was raised to 1 (a very thin image): shorten the other then.
    if w * h > max_pixels:
        w, h = (max_pixels, 1) if h == 1 else (1, max_pixels)
    return w, h


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_of(*candidates: tuple[str, Any]) -> Any:
    """The value of whichever field is present; two present and different is ambiguous."""
    present = [(name, value) for name, value in candidates if value is not None]
    if len(present) > 1 and any(value != present[0][1] for _, value in present[1:]):
        names = " and ".join(f"{name}={value!r}" for name, value in present)
        raise _BadRow(f"{present[0][0]}: ambiguous, {names} differ; keep one")
    return present[0][1] if present else None


def _ground_truth(value: Any) -> str:
    # Numbers are common in hand-made files; keep their text. A list of answers has no single truth.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow(f"reward_model.ground_truth: a {type(value).__name__}; use a string (or a number)")
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadRow(f"reward_model.ground_truth: {value}; use a finite number or a string")
    text = str(value)
    if not text.strip():
        raise _BadRow("reward_model.ground_truth: empty string; give the answer the verifier checks")
    return text


def _object(row: dict, name: str) -> dict | None:
    value = row.get(name)
    if value is not None and not isinstance(value, dict):
        raise _BadRow(f"{name}: a {type(value).__name__}; it must be an object (a dict)")
    return value


def _get(obj: dict | None, key: str) -> Any:
    return None if obj is None else obj.get(key)


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _BadRow(f"{name}: a {type(value).__name__}; use a string")
    return value


def _optional_str(row: dict, name: str) -> str | None:
    value = row.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _BadRow(f"{name}: {value!r}; use a non-empty string or leave it out")
    return value


def _text_or_int(value: Any, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise _BadRow(f"{name}: {value!r}; use a non-empty string or an integer")
    return str(value)


def _difficulty(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadRow(f"difficulty: {value!r}; use a finite number or leave it out")
    return float(value)
