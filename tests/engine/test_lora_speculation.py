"""Speculative decoding and structured outputs on LoRA adapter rows, through the engine
core on a tiny model whose greedy text repeats itself (n-gram drafts get accepted): the
verification rows run the request's adapter, so an adapter's greedy tokens with n-gram
drafts are PeftModel.generate's, and under a grammar the same as without drafts; the
base model's rows beside them keep theirs; the pool whole afterwards."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.core_setup import build_core_parts
from engine.messages import AddRequests, NewRequest
from model_runner.config import LoRAConfig, ModelConfig
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams
from structured.grammars import choice_grammar, regex_grammar
from tests.support.lora_helpers import ADAPTER_SPECS, TinyAdapter, make_adapter
from tests.support.model_helpers import TinyModel, greedy_margin, make_repeating_model

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
PROMPT = [1, 2] + [100] * 4 + [7, 8] * 6
GRAMMARS = {
    "regex": regex_grammar("(ab|abc){4,12}!"),
    "choice": choice_grammar(["no way, not today", "yes yes yes yes yes yes yes"]),
}


@pytest.fixture(scope="module")
def tiny_and_adapter(tmp_path_factory) -> tuple[TinyModel, TinyAdapter]:
    root = tmp_path_factory.mktemp("lora-spec")
    tiny = make_repeating_model(root / "model", live_ids=512)
    return tiny, make_adapter(root / "attn", tiny.hf, "attn", 3, **ADAPTER_SPECS["attn"])


def build(tiny: TinyModel, adapter: TinyAdapter,
          speculative: SpeculativeConfig | None) -> EngineCore:
    lora = LoRAConfig(modules=((adapter.name, adapter.path),), max_loras=1,
                      max_lora_rank=16)
    model_config = ModelConfig(model=tiny.loaded.model_path, block_size=4, num_kv_blocks=96,
                               lora=lora)
    scheduler, runner, info, structured = build_core_parts(
        model_config, SchedulerConfig(policy="priority", max_num_seqs=8,
                                      max_num_batched_tokens=48, max_model_len=256,
                                      speculative=speculative))
    return EngineCore(scheduler, runner, frozenset(info.eos_token_ids), structured=structured)


def run(core: EngineCore) -> dict[str, list[int]]:
    """Greedy requests: the adapter's and the base model's unconstrained, and the
    adapter's under each grammar; each one's tokens."""
    requests = [
        NewRequest(request_id=f"{lora or 'base'}-{name}", prompt_token_ids=PROMPT,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=24,
                                                  ignore_eos=grammar is None,
                                                  grammar=grammar),
                   placement=Placement(lora_name=lora))
        for lora, name, grammar in [("attn", "free", None), (None, "free", None),
                                    *(("attn", n, g) for n, g in GRAMMARS.items())]]
    core.apply(AddRequests(requests))
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for delta in core.step_fn().deltas:
            assert delta.error is None, delta.error
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    core.scheduler.check_integrity()
    assert core.scheduler.kv_cache.num_free_blocks == core.scheduler.kv_cache.num_blocks
    return tokens


def test_drafts_and_grammars_on_adapter_rows(tiny_and_adapter) -> None:
    tiny, adapter = tiny_and_adapter
    without = run(build(tiny, adapter, None))
    core = build(tiny, adapter, SPEC)
    got = run(core)
    stats = core.scheduler.stats.spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    assert got == without
    assert got["attn-free"] == greedy_margin(adapter.peft, PROMPT, 24)[0]
    assert got["base-free"] == greedy_margin(tiny.hf, PROMPT, 24)[0]
    assert got["attn-free"] != got["base-free"]  # the adapter's rows ran the adapter
    text = tiny.loaded.tokenizer.decode(got["attn-choice"])
    assert text in ("no way, not today", "yes yes yes yes yes yes yes")
