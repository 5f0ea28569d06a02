"""The shipped tasks' loader: a JSON-lines file beside the YAML that names it, as the `test` split.

A task of your own reads files through `datasets` (`dataset_path: json`, `dataset_kwargs.data_files`:
paths relative to the working directory); the shipped ones are read from the package, wherever it is
installed, hence this loader (the harness calls a YAML's `custom_dataset` with its `dataset_kwargs`).
"""

import json
import pathlib


def jsonl(file: str, **unused):
    """The records of `file` (a name in this directory) as a DatasetDict with one split, `test`.

    Args:
        file: the file's name.
        **unused (object): the harness's metadata (version, model arguments).

    Returns:
        datasets.DatasetDict: {"test": the records}.
    """
    import datasets

    path = pathlib.Path(__file__).parent / file
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
