"""LoRA adapters through the engine and the HTTP routes, on a tiny Llama with three
PEFT adapters and one slot (--max-loras 1, --max-cpu-loras 1): a request names its
adapter in `model` and gets PeftModel.generate's tokens, the cold adapter loading off
the step and evicting the idle one; /v1/models lists the adapters under their parent;
an unknown adapter is a 404, one the tenant may not use a 403, one whose folder broke
after the start fails its own request alone; the metrics the gateway reads; adapters
loaded and unloaded at run time."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.client import EngineClient, EngineInfo
from engine.core_setup import build_core_parts
from engine.metrics import ServerMetrics
from model_runner.config import LoRAConfig, ModelConfig
from scheduler.config import SchedulerConfig
from scheduler.placement import Placement
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from server.app import build_app
from server.config import ServerConfig
from server.tenants import TenantRegistry, TenantSpec
from tests.support.lora_helpers import ADAPTER_SPECS, make_adapter
from tests.support.metrics import metric_in
from tests.support.model_helpers import CONFIGS, greedy_margin, make_model_folder, prompts
from tests.support.scheduler_helpers import make_scheduler, step

KEYS = {"everything": "key-everything", "alpha-only": "key-alpha"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    hf = make_model_folder(root / "model", CONFIGS["smollm2"]())
    adapters = {name: make_adapter(root / name, hf, name, seed, **ADAPTER_SPECS[spec])
                for seed, (name, spec) in enumerate([("alpha", "all"), ("beta", "mlp"),
                                                     ("broken", "attn")])}
    lora = LoRAConfig(modules=tuple((a.name, a.path) for a in adapters.values()),
                      max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    model_config = ModelConfig(model=str(root / "model"), block_size=4, num_kv_blocks=64,
                               lora=lora)
    scheduler, runner, core_info, _ = build_core_parts(
        model_config, SchedulerConfig(policy="priority", max_model_len=128))
    spare = {"gamma": make_adapter(root / "gamma", hf, "gamma", 7, **ADAPTER_SPECS["attn"]),
             "wide": make_adapter(root / "wide", hf, "wide", 8, r=32, lora_alpha=8,
                                  target_modules=["q_proj"])}
    shutil.rmtree(root / "broken")  # checked at the start, gone when its request comes
    tokenizer = build_tokenizer(root / "model")
    info = EngineInfo(model_name="tiny", max_model_len=scheduler.max_request_len,
                      vocab_size=core_info.vocab_size, policy="priority",
                      tokenizer=tokenizer, eos_token_ids=frozenset(core_info.eos_token_ids),
                      loras=core_info.loras)
    engine = EngineClient.in_process(scheduler, runner, info)
    specs = [TenantSpec(name=name, api_key_sha256=[hashlib.sha256(key.encode()).hexdigest()],
                        loras=["alpha"] if name == "alpha-only" else None,
                        admin=name == "everything")
             for name, key in KEYS.items()]
    config = ServerConfig(runtime_lora_updating=True)
    with TestClient(build_app(engine, config, TenantRegistry(specs))) as client:
        yield client, hf, {**adapters, **spare}, tokenizer


def build_tokenizer(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def complete(client, model: str, prompt: list[int], key: str = KEYS["everything"]):
    return client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "prompt": prompt, "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})


def test_adapters_named_in_model_give_peft_tokens_loading_off_the_step(served):
    client, hf, adapters, tokenizer = served
    (prompt,) = prompts([11], seed=12)
    # alpha is loaded from the start; beta loads when asked (evicting idle alpha), then
    # alpha again
    for model in ["alpha", "beta", "tiny", "alpha"]:
        response = complete(client, model, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        reference = hf if model == "tiny" else adapters[model].peft
        want = tokenizer.decode(greedy_margin(reference, prompt, 8)[0])
        assert response.json()["choices"][0]["text"] == want, model
    metrics = client.get("/metrics").text
    assert metric_in(metrics, "pagedserve_lora_requests_total", lora_name="alpha") == 2
    assert metric_in(metrics, "pagedserve_lora_requests_total", lora_name="beta") == 1
    # as the gateway's endpoint picker reads it: the newest sample's labels
    (family,) = [f for f in text_string_to_metric_families(metrics)
                 if f.name == "vllm:lora_requests_info"]
    newest = max(family.samples, key=lambda sample: sample.value)
    assert newest.labels["max_lora"] == "1"
    assert newest.labels["running_lora_adapters"] == ""
    assert newest.labels["waiting_lora_adapters"] == ""


def test_models_lists_the_adapters_under_their_parent(served):
    client, *_ = served
    cards = client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['everything']}"}
                       ).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [
        ("tiny", None), ("alpha", "tiny"), ("beta", "tiny"), ("broken", "tiny")]


def test_an_unknown_adapter_is_a_404_naming_it(served):
    client, *_ = served
    response = complete(client, "gamma", [5, 6, 7])
    assert response.status_code == 404
    assert "`gamma` does not exist" in response.json()["error"]["message"]


def test_a_tenant_held_to_its_adapters_gets_a_403(served):
    client, *_ = served
    response = complete(client, "beta", [5, 6, 7], key=KEYS["alpha-only"])
    assert response.status_code == 403
    assert "`beta`" in response.json()["error"]["message"]
    assert complete(client, "alpha", [5, 6, 7], key=KEYS["alpha-only"]).status_code == 200


def test_an_adapter_that_fails_to_load_fails_its_request_alone(served):
    client, *_ = served
    response = complete(client, "broken", [5, 6, 7])
    assert response.status_code == 400
    assert "'broken' failed to load" in response.json()["error"]["message"]
    assert complete(client, "tiny", [5, 6, 7]).status_code == 200
    assert complete(client, "alpha", [5, 6, 7]).status_code == 200


def test_adapters_loaded_and_unloaded_at_run_time(served):
    client, hf, adapters, tokenizer = served
    admin = {"Authorization": f"Bearer {KEYS['everything']}"}

    def post(route: str, headers=admin, **body):
        return client.post(f"/v1/{route}_lora_adapter", headers=headers, json=body)

    gamma = adapters["gamma"]
    assert post("load", headers={"Authorization": f"Bearer {KEYS['alpha-only']}"},
                lora_name="gamma", lora_path=gamma.path).status_code == 403
    wide = post("load", lora_name="wide", lora_path=adapters["wide"].path)
    assert wide.status_code == 400 and "over --max-lora-rank 16" in wide.text
    assert post("load", lora_name="gamma", lora_path=gamma.path).status_code == 200
    assert post("load", lora_name="gamma", lora_path=gamma.path).status_code == 400
    models = [c["id"] for c in client.get("/v1/models", headers=admin).json()["data"]]
    assert "gamma" in models and "wide" not in models
    (prompt,) = prompts([9], seed=13)
    response = complete(client, "gamma", prompt)
    assert response.json()["choices"][0]["text"] == tokenizer.decode(
        greedy_margin(gamma.peft, prompt, 8)[0])
    assert post("unload", lora_name="gamma").status_code == 200
    assert complete(client, "gamma", prompt).status_code == 404
    assert post("unload", lora_name="gamma").status_code == 404


def test_the_gateway_reads_the_adapters_running_and_waiting():
    """`vllm:lora_requests_info` as the endpoint picker parses it (the newest sample's
    labels), from the scheduler's stats of one adapter running and two waiting."""
    scheduler = make_scheduler(policy="priority", max_loras=1, max_cpu_loras=2)
    scheduler.lora_loaded("sql")
    for request_id, lora, priority in [("r0", "sql", 0), ("r1", "chat", 1), ("r2", "math", 2)]:
        scheduler.add_request(Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4),
                                      placement=Placement(priority=priority, lora_name=lora)))
    step(scheduler)
    stats = scheduler.stats
    assert (stats.running_loras, stats.waiting_loras) == (("sql",), ("chat", "math"))
    metrics = ServerMetrics("tiny")
    metrics.set_lora_info(stats.max_loras, stats.running_loras, stats.waiting_loras)
    text = metrics.render().decode()
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "vllm:lora_requests_info"]
    newest = max(family.samples, key=lambda sample: sample.value)
    assert newest.labels == {"running_lora_adapters": "sql", "max_lora": "1",
                             "waiting_lora_adapters": "chat,math"}
