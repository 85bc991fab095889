"""Helpers shared by the evaluation and study tests (a helper module, not a test file): lm-eval task files
written as a user writes them (a YAML beside its JSON-lines data), and a small generated corpus."""

from __future__ import annotations

import json
import os

# The words of the generated corpora: frequent enough that a 300-token BPE learns them in a few documents.
WORDS = ("the of and to in that he shall unto for his a lord they be is him not them it with all thou thy "
         "was god which my me said but ye their have will thee from as are when this out were upon man by "
         "you israel king son up there hath then people came had house into her").split()

# What a multiple-choice task asks of each JSON line: question, choices, answer (the index of the right one).
MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def task_yaml(task: str, data_file: str, body: str = MULTIPLE_CHOICE) -> str:
    """A local lm-eval task reading its test split from ``data_file`` (JSON lines); ``body`` says what a
    line holds and how it is scored."""
    return (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\n"
            f"test_split: test\n{body}")


def write_task(folder, task: str, rows: list[dict], body: str = MULTIPLE_CHOICE, data_name: str | None = None) -> str:
    """``rows`` as ``<folder>/<data_name>.jsonl`` (default: the task's name) and the task's YAML beside them;
    -> the folder."""
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, f"{data_name or task}.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(os.path.join(folder, f"{task}.yaml"), "w") as f:
        f.write(task_yaml(task, data, body))
    return str(folder)


def write_word_corpus(root, rng, documents: int = 12) -> None:
    """``documents`` text files of 8 sentences of 5-14 of ``WORDS`` each, drawn from ``rng`` (a numpy
    Generator, left advanced: a caller may draw a task from it next), as ``<root>/docNN.txt``."""
    for i in range(documents):
        text = "\n".join(" ".join(rng.choice(WORDS, rng.integers(5, 15))) + "." for _ in range(8))
        with open(os.path.join(root, f"doc{i:02d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)


# ------------------------------------------------------------- the evaluation tests' three kinds of task
VERSES = ["In the beginning God created the heaven and the earth.", "And the earth was without form, and void;",
          "And God said, Let there be light: and there was light.", "And God saw the light, that it was good:",
          "And God called the light Day, and the darkness he called Night."]
GENERATE = """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
ROLLING = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""
TASKS = ["tf_mc", "tf_gen", "tf_roll"]


def write_tasks(folder) -> str:
    """``TASKS`` in ``folder``: a multiple-choice, a generation and a rolling-loglikelihood task on
    ``VERSES``, each a YAML and its JSON-lines data file; -> the folder."""
    mc = [{"question": " ".join(v.split()[:-2]), "choices": [" ".join(v.split()[-2:]), "the fish", "of the sea",
                                                              "and Lord"], "answer": 0} for v in VERSES]
    gen = [{"prompt": " ".join(v.split()[:4]), "target": " " + " ".join(v.split()[4:6])} for v in VERSES]
    roll = [{"text": " ".join([v] * 6)} for v in VERSES[:3]]   # several rolling windows of a 64-token context
    write_task(folder, "tf_mc", mc, data_name="mc")
    write_task(folder, "tf_gen", gen, GENERATE, data_name="gen")
    return write_task(folder, "tf_roll", roll, ROLLING, data_name="roll")
