"""The local data files of a task YAML, checked before lm-eval reads them (``tieflax.eval.tasks``).

A local task (``dataset_path: json`` with ``dataset_kwargs.data_files``, as ``examples/tasks`` has it) is
read by the ``datasets`` JSON loader inside lm-eval: a file cut mid-line or emptied fails there with a
traceback of some 50-100 lines that names neither the task nor the line, and a multiple-choice item whose
answer is not one of its choices is scored, as wrong for every model, with a warning lost in lm-eval's
log. Here each is one line naming the task file, the data file, the line (or item) and the fix.

Only what the JSON loader reads (``.json`` / ``.jsonl`` files on this machine) is checked; a remote file,
another format or a task built from a Hugging Face dataset is left to lm-eval.
"""

from __future__ import annotations

import glob
import json
import os
import re

from tieflax.eval.decode import EvalError

_FIELD = re.compile(r"\s*\{\{\s*(\w+)\s*\}\}\s*")   # doc_to_choice / doc_to_target naming one field
_SHOWN = 120                                         # characters of an item shown in the error line


def check_task_data(task_file: str, config) -> None:
    """``config``: the parsed task YAML ``task_file``. Every local JSON data file it names holds at least
    one item, every line is a JSON object, and every multiple-choice answer is one of its item's choices."""
    if not isinstance(config, dict) or config.get("dataset_path") != "json":
        return
    kwargs = config.get("dataset_kwargs")
    if not isinstance(kwargs, dict):
        return
    answers = _answer_fields(config)
    for name in _names(kwargs.get("data_files")):
        if "://" in name or not name.endswith((".json", ".jsonl")):
            continue
        pattern = os.path.join(str(kwargs.get("data_dir") or ""), os.path.expanduser(name))
        paths = sorted(glob.glob(pattern, recursive=True)) if set("*?[") & set(name) else [pattern]
        if not paths or not os.path.isfile(paths[0]):
            raise EvalError(f"task file {task_file}: its data file {name} does not exist (a relative path is read "
                            f"from the folder the command runs in, {os.getcwd()}): run from the folder it is "
                            "relative to, or give an absolute path")
        for path in paths:
            items = _items(task_file, path, kwargs.get("field"))
            if answers is not None:
                for where, item in items:
                    _check_answer(task_file, path, where, item, *answers)


def _names(data_files) -> list[str]:
    """The file names of ``dataset_kwargs.data_files``: a name, a list of them, or a split -> either."""
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [n for v in data_files.values() for n in _names(v)]
    if isinstance(data_files, (list, tuple)):
        return [n for v in data_files for n in _names(v)]
    return []


def _answer_fields(config) -> tuple[str, str, bool] | None:
    """``(choices field, answer field, answer templated)`` of a multiple-choice task whose choices and answer
    are each one field of the item (``{{choices}}`` or ``choices``), else None (nothing to check)."""
    if config.get("output_type") != "multiple_choice":
        return None
    fields = []
    for key in ("doc_to_choice", "doc_to_target"):
        value = config.get(key)
        if not isinstance(value, str):
            return None
        m = _FIELD.fullmatch(value)
        if m is None and not re.fullmatch(r"\w+", value):
            return None
        fields.append((m.group(1), True) if m else (value, False))
    (choices, _), (answer, templated) = fields
    return choices, answer, templated


def _items(task_file: str, path: str, field) -> list[tuple[str, object]]:
    """``[(where, item)]`` of one data file: JSON lines (``line N``) or one JSON array (``item N``)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise EvalError(f"task file {task_file}: its data file {path} is not UTF-8 text ({e.reason} at byte "
                        f"{e.start}): save it as UTF-8") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    try:
        whole = json.loads(text) if lines else None
    except ValueError:
        whole = None
    if isinstance(whole, dict) and isinstance(field, str) and isinstance(whole.get(field), list):
        whole = whole[field]
    if isinstance(whole, list):
        items = [(f"item {i}", item) for i, item in enumerate(whole, 1)]
    elif isinstance(whole, dict) and len(lines) > 1:
        return []   # one JSON object over several lines (columns): the loader's own format, not items
    else:
        items = []
        for n, line in lines:
            try:
                items.append((f"line {n}", json.loads(line)))
            except ValueError as e:
                raise EvalError(f"task file {task_file}: its data file {path}, line {n}: not a JSON object "
                                f"({e}); the line is cut or damaged: fix or remove it") from None
    if not items:
        raise EvalError(f"task file {task_file}: its data file {path} holds no items: an empty file has nothing "
                        "to score; restore its items (one JSON object a line)")
    return items


def _check_answer(task_file: str, path: str, where: str, item, choices_field: str, answer_field: str,
                  templated: bool) -> None:
    """One line when ``item``'s answer is neither an index into its choices nor one of their texts (lm-eval
    would score the item as wrong for every model, or a negative index as the choice counted from the end)."""
    if not isinstance(item, dict):
        raise EvalError(f"task file {task_file}: its data file {path}, {where}: {_shown(item)} is not a JSON "
                        "object; give each item as {\"field\": value, ...}")
    choices, answer = item.get(choices_field), item.get(answer_field)
    if not isinstance(choices, list) or answer is None:
        return   # a field missing or of another kind: the template's own error (tieflax.eval.tasks)
    gold = answer
    if templated and not isinstance(answer, list):   # lm-eval renders the template: digits become an index
        gold = int(str(answer)) if str(answer).isdigit() else str(answer)
    golds = gold if isinstance(gold, list) else [gold]
    for g in golds:
        index = isinstance(g, int) and not isinstance(g, bool)
        if (index and 0 <= g < len(choices)) or (not index and g in choices):
            continue
        n = len(choices)
        raise EvalError(f"task file {task_file}: its data file {path}, {where}: the answer ({answer_field} = "
                        f"{answer!r}) is not one of the item's {n} choices (an index 0..{n - 1} or a choice's "
                        f"text): lm-eval would score it as wrong for every model; fix the item {_shown(item)}")


def _shown(item) -> str:
    text = json.dumps(item, ensure_ascii=False)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
