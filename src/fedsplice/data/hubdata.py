"""data.dataset = "hf:NAME[:CONFIG]": a Hugging Face `datasets` data set (docs/data.md).

NAME is a hub id (read through `datasets.load_dataset`, which needs the hub or its cache) or a
local folder: one written by `save_to_disk` (read with `datasets.load_from_disk`), or one of data
files `load_dataset` reads (parquet, CSV, JSON; split names from the file names). The settings
name the columns (data.hf_text, data.hf_image, data.hf_label) and the splits (data.hf_train_split,
data.hf_test_split); the named test split is used exactly, like a user's `split` column, and an
empty one has a balanced test set carved. Class names come from the label column's `ClassLabel`
feature (in its order), else from the labels themselves (sorted, as for users' files).
With model.task = "generate" the rows are instruction records under their own field names
(`load_hub_instructions`; fedsplice.data.instruct).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedsplice.data import images as imagedata
from fedsplice.data import instruct
from fedsplice.data.assets import cache_dir
from fedsplice.data.samples import Sample
from fedsplice.data.text import normalize_ws
from fedsplice.data.userdata import group
from fedsplice.errors import ConfigError


@dataclass(frozen=True)
class HubColumns:
    text: str = "text"
    image: str = ""
    label: str = "label"
    train: str = "train"
    test: str = "test"  # "": carve a balanced test set


def _datasets():
    try:
        import datasets  # heavy (pyarrow, pandas): only for hf: data
    except ImportError:
        raise ConfigError("data.dataset = 'hf:...' reads data through Hugging Face `datasets`, which is not "
                          "installed: pip install 'fedsplice[hf]'") from None
    datasets.disable_progress_bars()
    return datasets


def open_dataset(spec: str):
    """The DatasetDict of hf:`spec` (NAME[:CONFIG]); a single Dataset becomes its "train" split."""
    ds_lib = _datasets()
    name, _, config = spec.partition(":")
    local = Path(name).expanduser()
    try:
        if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            got = ds_lib.load_from_disk(str(local))
        else:
            got = ds_lib.load_dataset(str(local) if local.is_dir() else name, config or None,
                                      cache_dir=str(cache_dir() / "hf-datasets"))
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"data.dataset = 'hf:{spec}': `datasets` could not load it ({first}); give a hub id "
                          f"(online, or in the hub cache) or a local folder written by `datasets`") from None
    return got if isinstance(got, ds_lib.DatasetDict) else ds_lib.DatasetDict({"train": got})


def _check(dd, cols: HubColumns, where: str) -> None:
    splits = ", ".join(dd)
    for field, split in (("data.hf_train_split", cols.train), ("data.hf_test_split", cols.test)):
        if split and split not in dd:
            hint = "; or set it to '' to carve a test set" if field.endswith("test_split") else ""
            raise ConfigError(f"{field} = {split!r}: {where} has no such split (its splits: {splits}){hint}")
    for split in filter(None, (cols.train, cols.test)):
        columns = dd[split].column_names
        for field, col in (("data.hf_label", cols.label), ("data.hf_text", cols.text),
                           ("data.hf_image", cols.image)):
            if col and col not in columns:
                raise ConfigError(f"{field} = {col!r}: the {split!r} split of {where} has no such column (its "
                                  f"columns: {', '.join(columns)})")


def _rows(d, cols: HubColumns, names: list[str] | None, where: str, log, out: tuple[list, list]) -> dict:
    """Append the split's samples and labels to `out`; return {label: first row number}."""
    ds_lib = _datasets()
    if cols.image:  # the encoded bytes: decoded, checked and keyed by content here, as users' images are
        d = d.cast_column(cols.image, ds_lib.Image(decode=False))
    first: dict[str, int] = {}
    columns = [c for c in (cols.label, cols.text, cols.image) if c]
    for i, row in enumerate(d.select_columns(columns)):
        at = f"{where} row {i}"
        y = row[cols.label]
        if y is None or (names is not None and not 0 <= int(y) < len(names)):
            raise ConfigError(f"{at}: no label ({y!r}; unlabelled rows, as in many hub test splits): choose a "
                              f"labelled split for data.hf_test_split, or '' to carve a test set")
        label = names[int(y)] if names is not None else str(y).strip()
        text = row[cols.text] if cols.text else None
        text = normalize_ws(str(text)) if text is not None and str(text).strip() else None
        item = text
        if cols.image and row[cols.image] is not None:
            raw = row[cols.image]["bytes"] or Path(row[cols.image]["path"]).read_bytes()
            try:
                rgb = imagedata.decode_bytes(raw)
            except imagedata.BadImage as e:
                if not log.skip:
                    raise ConfigError(f"{at}: image {e}, or set data.skip_bad_images = true to skip bad "
                                      f"images") from None
                log.skipped += 1
                continue
            item = Sample(imagedata.content_key(f"{d.split or 'split'}/{i}", raw, text), rgb, text)
        if item is None:
            raise ConfigError(f"{at}: no text and no image; every row needs a non-empty {cols.text or cols.image!r}")
        out[0].append(item)
        out[1].append(label)
        first.setdefault(label, i)
    return first


def load_hub_instructions(spec: str, cols: HubColumns, group_field: str,
                          reader: Callable[[dict, str], instruct.Instruction] = instruct.record) -> dict:
    """The parsed form of hf:`spec` holding instruction records (model.task = "generate"): each
    row in any of `fedsplice.data.instruct`'s forms, its own field names (or as `reader` makes
    it: data.record_format); the splits as named."""
    where = f"hf:{spec}"
    dd = open_dataset(spec)
    _check(dd, HubColumns(text="", label="", train=cols.train, test=cols.test), where)
    recs: list[instruct.Instruction] = []
    splits: list[str | None] = []
    for split, tag in ((cols.train, "train" if cols.test else None), (cols.test, "test")):
        if split:
            d = dd[split]
            image = _datasets().Image
            if isinstance(d.features.get("image"), image):  # the VLM path: undecoded, keyed by content
                d = d.cast_column("image", image(decode=False))
            for i, row in enumerate(d):
                recs.append(reader(dict(row), f"{where} split {split!r} row {i}"))
                splits.append(tag)
    given = f"given: the {cols.train!r} / {cols.test!r} splits of {where}" if cols.test else ""
    return instruct.grouped(recs, where, "", group_field, f"Hugging Face data set {spec}", splits, given)


def load_hub(spec: str, cols: HubColumns, skip_bad_images: bool = False) -> dict:
    """The parsed form (fedsplice.data.datasets) of hf:`spec`."""
    where = f"hf:{spec}"
    dd = open_dataset(spec)
    _check(dd, cols, where)
    feat = dd[cols.train].features[cols.label]
    names = list(feat.names) if hasattr(feat, "names") else None  # a ClassLabel's classes, in its order
    log = imagedata.BadImageLog(skip_bad_images)
    items: list = []
    labels: list[str] = []
    splits: list[str | None] = []
    first: dict[str, int] = {}
    for split, tag in ((cols.train, "train" if cols.test else None), (cols.test, "test")):
        if split:
            n = len(items)
            f = _rows(dd[split], cols, names, f"{where} split {split!r}", log, (items, labels))
            first = first or f
            splits += [tag] * (len(items) - n)
    log.summary(where)
    given = f"given: the {cols.train!r} / {cols.test!r} splits of {where}" if cols.test else ""
    return group(items, labels, splits, {"bad_images": log.skipped, "first_line": first}, "hf", where, None,
                 skip_bad_images, names or [], source=f"Hugging Face data set {spec}", given_as=given)
