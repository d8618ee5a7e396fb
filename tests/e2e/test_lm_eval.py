"""lm-eval's `local-completions` model against the real server (float32, the default
model) on a small multiple-choice task made here: each choice's loglikelihood (the sum
of its echoed prompt logprobs) is what lm-eval's `hf` model computes on the same
checkpoint, and so is the accuracy. Nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model

TOLERANCE = 1e-3
# (question, choices, the answer's index): some the small model gets right, some not
DOCS = [
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("Two plus two equals", [" four", " seven", " ten"], 0),
    ("The sky on a clear day is", [" green", " blue", " red"], 1),
    ("Water freezes at zero degrees", [" Fahrenheit", " Celsius", " Kelvin"], 1),
    ("A cat says", [" woof", " moo", " meow"], 2),
    ("The sun rises in the", [" west", " north", " east"], 2),
]
TASK = "pagedserve_echo_mc"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    _require_default_model()
    server = ServerProcess("--dtype", "float32", "--num-kv-blocks", "64")
    yield server
    server.stop()


@pytest.fixture
def task_folder(tmp_path: Path) -> Path:
    """The task's data (JSON lines) and YAML, read by lm-eval's TaskManager."""
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(
        json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in DOCS
    ))
    (tmp_path / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {tmp_path / "datasets"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return tmp_path


def evaluate(model, task_manager) -> tuple[float, list[list[float]]]:
    """lm-eval's accuracy of `model` on the task, and each doc's choice loglikelihoods."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=model, tasks=[TASK], bootstrap_iters=0, log_samples=True,
                          task_manager=task_manager)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out["results"][TASK]["acc,none"], [[r[0] for r in s["resps"]] for s in samples]


def test_local_completions_matches_the_hf_model(server, task_folder, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from model_runner.model_source import default_gguf_path, resolve_model_folder

    # NOTE: lm-eval's own tasks left out: indexing them takes most of a minute
    tasks = TaskManager(include_path=str(task_folder), include_defaults=False)
    folder, name = resolve_model_folder(None)
    api = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=name,
                              tokenizer=str(folder), tokenizer_backend="huggingface",
                              batch_size=3)  # three token-id prompts a request
    api_accuracy, api_loglikelihoods = evaluate(api, tasks)
    gguf = default_gguf_path()
    hf = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, tokenizer=str(folder),
              dtype="float32", device="cpu", batch_size=8)
    hf_accuracy, hf_loglikelihoods = evaluate(hf, tasks)
    assert len(api_loglikelihoods) == len(DOCS)
    for doc, api_doc, hf_doc in zip(DOCS, api_loglikelihoods, hf_loglikelihoods, strict=True):
        assert len(api_doc) == len(hf_doc) == len(doc[1])
        for got, expected in zip(api_doc, hf_doc, strict=True):
            assert got == pytest.approx(expected, abs=TOLERANCE), (doc, api_doc, hf_doc)
    assert api_accuracy == hf_accuracy
    assert 0 < api_accuracy < 1  # the task tells choices apart, not trivially
