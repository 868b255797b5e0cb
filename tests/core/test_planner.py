"""The capacity planner's arithmetic on published model shapes, checked by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from fleetserve.platform.config import ModelConfig, ReplicaProfile, parse_config
from fleetserve.ops.gpus import GPUS, gpu
from fleetserve.ops.planner import (
    GiB,
    LoraSlots,
    ModelPlan,
    Partitioning,
    PlanError,
    PlanInputs,
    chart_values,
    model_shape,
    pack,
    params_from_config,
    plan_config,
    plan_model,
)
from fleetserve.ops.replica_profile import profile_yaml, replica_profile, vllm_batch_defaults

# Published config.json shapes (Hugging Face model cards).
LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA_3_70B = {**LLAMA_3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64}
QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
QWEN2_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA_3_2_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
INPUTS = PlanInputs(context_len=4096, concurrency=8)
MIG, WHOLE, SHARED = Partitioning.MIG, Partitioning.WHOLE, Partitioning.SHARED


def folder(tmp_path: Path, name: str, config: dict) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_parameter_counts_match_the_published_sizes():
    # Llama-3-8B: embeddings 128256*4096 = 525,336,576, twice (untied head) = 1,050,673,152; per layer
    # q,o 2*4096*4096 + k,v 2*4096*1024 = 41,943,040, MLP 3*4096*14336 = 176,160,768, norms 8,192
    # -> 218,112,000 * 32 = 6,979,584,000; + final norm 4,096 = 8,030,261,248.
    assert params_from_config(LLAMA_3_8B) == 8_030_261_248
    # Llama-3-70B: 2*128256*8192 = 2,101,346,304; per layer 134,217,728 + 16,777,216 + 704,643,072 + 16,384
    # = 855,654,400 * 80 = 68,452,352,000; + 8,192 = 70,553,706,496.
    assert params_from_config(LLAMA_3_70B) == 70_553_706_496
    # Qwen2-7B: 2*152064*3584 = 1,089,994,752; per layer q,o 2*12,845,056 + k,v 2*1,835,008 + qkv biases
    # 4,608 + MLP 203,685,888 + norms 7,168 = 233,057,792 * 28 = 6,525,618,176; + 3,584 = 7,615,616,512.
    assert params_from_config(QWEN2_7B) == 7_615_616_512


@pytest.mark.parametrize("config, expected", [
    (LLAMA_3_8B, 131_072),   # 2 * 32 layers * 8 kv heads * 128 head_dim * 2 bytes
    (LLAMA_3_70B, 327_680),  # 2 * 80 * 8 * 128 * 2
    (QWEN2_7B, 57_344),      # 2 * 28 * 4 * 128 * 2 (head_dim 3584 / 28)
])
def test_kv_bytes_per_token(tmp_path, config, expected):
    assert model_shape("m", folder(tmp_path, "m", config)).kv_bytes_per_token == expected


def test_llama_3_8b_on_h100_mig_takes_3g_40gb(tmp_path):
    shape = model_shape("llama-3-8b", folder(tmp_path, "l", LLAMA_3_8B))
    plan = plan_model(shape, gpu("h100-80gb"), MIG, INPUTS)
    # weights 8,030,261,248 * 2 = 16,060,522,496; KV 8 * 4096 * 131,072 = 4,294,967,296; need 20,355,489,792.
    assert plan.weight_bytes == 16_060_522_496 and plan.need_bytes == 20_355_489_792
    # usable = memory * 0.9 - 1 GiB: 2g.20gb 16,926,258,176 < need <= 3g.40gb 34,926,258,176.
    assert plan.slice == "3g.40gb" and plan.slice_usable_bytes == 34_926_258_176
    # (34,926,258,176 - 16,060,522,496) // (4096 * 131,072) = 18,865,735,680 // 536,870,912 = 35.
    assert plan.max_concurrent_seqs == 35
    # 3g.40gb has 4 of 8 memory slices: 3.35e12 / 2 = 1.675e12 B/s; 8 * 1.675e12 / 20,355,489,792 = 658.30.
    assert plan.decode_tokens_per_s == pytest.approx(658.299, rel=1e-5)
    assert plan.single_stream_tokens_per_s == pytest.approx(1.675e12 / 16_060_522_496)
    # $4/h * max(3/7, 4/8) / (658.30 * 3600) * 1e6 = $0.8439 per 1M output tokens.
    assert plan.cost_per_million_output_tokens == pytest.approx(0.84393, rel=1e-4)
    # 16,060,522,496 / 2e9 + 30 s = 38.03 s.
    assert plan.cold_start_s == pytest.approx(38.0303, rel=1e-5)


def test_a_planned_replica_becomes_the_simulators_replica_profile(tmp_path):
    plan = plan_model(model_shape("llama-3-8b", folder(tmp_path, "l", LLAMA_3_8B)), gpu("h100-80gb"), MIG, INPUTS)
    # KV: (34,926,258,176 usable - 16,060,522,496 weights) // 131,072 per token = 143,934 tokens.
    assert plan.kv_capacity_tokens == 143_934
    # 989e12 FLOP/s x 3/7 compute slices x 0.3 efficiency = 127.157e12 sustained; a token is 2 x 8,030,261,248
    # FLOPs: 7,917.37 prompt tokens/s, and one sequence's decode compute 1 / 7,917.37 = 126.3 us a step.
    assert plan.prefill_tokens_per_s == pytest.approx(989e12 * 3 / 7 * 0.3 / 16_060_522_496)
    assert plan.prefill_tokens_per_s == pytest.approx(7917.37, abs=0.01)
    assert plan.decode_step_per_seq_s == pytest.approx(1 / plan.prefill_tokens_per_s)
    # A step reads the weights once, 16,060,522,496 B at 1.675e12 B/s = 9.588 ms, and 131,072 B per KV token held.
    assert plan.decode_step_base_s == pytest.approx(16_060_522_496 / 1.675e12)
    assert plan.decode_step_per_kv_token_s == pytest.approx(131_072 / 1.675e12)
    profile = replica_profile(plan, ModelConfig(name="llama-3-8b", source="unused"), gpu("h100-80gb"))
    # The config leaves the batch limits to vLLM, which gives a 40 GB slice (37.3 GiB) 256 and 2048.
    assert (profile.max_num_seqs, profile.max_num_batched_tokens) == (256, 2048)
    assert (profile.kv_capacity_tokens, profile.startup_s) == (143_934, plan.cold_start_s)
    text = profile_yaml(profile, plan, gpu("h100-80gb"))
    assert ReplicaProfile.model_validate(yaml.safe_load(text)) == profile
    configured = ModelConfig(name="llama-3-8b", source="unused",
                             engine_args={"max_num_seqs": 64, "max_num_batched_tokens": 4096})
    assert replica_profile(plan, configured, gpu("h100-80gb")).max_num_seqs == 64


@pytest.mark.parametrize(("gpu_name", "slice_name", "expected"), [
    ("h100-80gb", None, (1024, 8192)),  # 80e9 B = 74.5 GiB >= 70 GiB
    ("h100-80gb", "7g.80gb", (1024, 8192)),
    ("h100-80gb", "3g.40gb", (256, 2048)),  # 37.3 GiB
    ("a100-80gb", None, (256, 2048)),  # an A100 is kept at the small defaults whatever its memory
    ("h200-141gb", None, (1024, 8192)),  # 131.3 GiB < 160 GiB
])
def test_vllm_batch_defaults_follow_the_device_memory(gpu_name, slice_name, expected):
    spec = gpu(gpu_name)
    memory = spec.memory_bytes if slice_name is None else spec.profile(slice_name).memory_bytes
    assert vllm_batch_defaults(memory, spec.name) == expected


def test_qwen2_7b_on_h200_mig_takes_1g_35gb(tmp_path):
    shape = model_shape("qwen2-7b", folder(tmp_path, "q", QWEN2_7B))
    plan = plan_model(shape, gpu("h200-141gb"), MIG, INPUTS)
    # need 15,231,233,024 + 8 * 4096 * 57,344 = 17,110,281,216; 1g.18gb holds 15,126,258,176, 1g.35gb 30,426,258,176.
    assert plan.need_bytes == 17_110_281_216
    assert plan.slice == "1g.35gb"


def test_quantized_70b_fits_a_whole_h100_slice_but_bf16_misses_by_its_excess(tmp_path):
    path = folder(tmp_path, "l70", LLAMA_3_70B)
    awq = plan_model(model_shape("llama-3-70b-awq", path, quantization="awq"), gpu("h100-80gb"), MIG, INPUTS)
    # 70,553,706,496 * 0.53 = 37,393,464,443 weights + 10,737,418,240 KV = 48,130,882,683 > 4g.40gb's 34.9e9.
    assert awq.slice == "7g.80gb"
    bf16 = model_shape("llama-3-70b", path)
    # need 141,107,412,992 + 10,737,418,240 = 151,844,831,232; 7g.80gb usable 70,926,258,176: short 75.4 GiB.
    with pytest.raises(PlanError, match=r"needs 141.4 GiB .* offers 66.1 GiB usable: short by 75.4 GiB"):
        plan_model(bf16, gpu("h100-80gb"), MIG, INPUTS)
    # A whole H200 (125,826,258,176 usable) misses by 151,844,831,232 - 125,826,258,176 = 24.2 GiB, so the plan
    # shards it (next test).
    assert plan_model(bf16, gpu("h200-141gb"), WHOLE, INPUTS).tensor_parallel_size == 2


@pytest.mark.parametrize(("gpu_name", "ranks", "kv_per_gpu", "max_seqs"), [
    # H100: 2 ranks need 70,553,706,496 weights + 8 x 4096 x 163,840 KV (4 of the 8 KV heads each) =
    # 75,922,415,616 > 70,926,258,176 usable; 4 ranks need 35,276,853,248 + 2,684,354,560: they fit.
    # KV per GPU: 70,926,258,176 - 35,276,853,248 = 35,649,404,928; / (4096 x 81,920) = 106 sequences.
    ("h100-80gb", 4, 35_649_404_928, 106),
    # H200: 75,922,415,616 <= 125,826,258,176 at 2 ranks; 125,826,258,176 - 70,553,706,496 = 55,272,551,680 of
    # KV per GPU, / (4096 x 163,840) = 82 sequences.
    ("h200-141gb", 2, 55_272_551_680, 82),
])
def test_a_model_no_gpu_holds_is_sharded_over_the_fewest_gpus_that_do(tmp_path, gpu_name, ranks, kv_per_gpu, max_seqs):
    plan = plan_model(model_shape("llama-3-70b", folder(tmp_path, "m", LLAMA_3_70B)), gpu(gpu_name), WHOLE, INPUTS)
    assert (plan.slice, plan.tensor_parallel_size) == ("gpu", ranks)
    assert (plan.kv_cache_bytes_per_gpu, plan.max_concurrent_seqs) == (kv_per_gpu, max_seqs)
    # Each rank holds and computes its share, side by side: the step reads one rank's weights (2 bytes a
    # parameter), and prefill runs at all the ranks' FLOPs (989e12 x 0.3 each over 2 FLOPs a parameter).
    bandwidth = gpu(gpu_name).memory_bandwidth_bytes_per_s
    assert plan.decode_step_base_s == pytest.approx(2 * 70_553_706_496 / ranks / bandwidth)
    assert plan.prefill_tokens_per_s == pytest.approx(ranks * 989e12 * 0.3 / (2 * 70_553_706_496))
    # A replica takes its GPUs whole: 2 replicas are 2 x ranks GPUs.
    assert len(pack([replace(plan, replicas=2)], gpu(gpu_name))) == 2 * ranks


def test_lora_buffers_take_their_room_from_the_kv_cache(tmp_path):
    shape = model_shape("llama-3-8b", folder(tmp_path, "l", LLAMA_3_8B))
    # Per layer, (in + out) of q 4096+4096, k and v 4096+1024 each, gate and up 4096+14336 each, o 4096+4096,
    # down 14336+4096 = 81,920; x 32 layers = 2,621,440; embedding and LM head 2 x (128,256 + 4,096) = 264,704;
    # 2,886,144 x rank 64 x 4 slots x 2 bytes (bf16) = 1,477,705,728.
    assert shape.lora_bytes_per_rank(LoraSlots(max_loras=4, max_lora_rank=64)) == 1_477_705_728
    plan = plan_model(shape, gpu("h100-80gb"), MIG, INPUTS, lora=LoraSlots(max_loras=4, max_lora_rank=64))
    # need 16,060,522,496 + 1,477,705,728 + 4,294,967,296 = 21,833,195,520: still 3g.40gb (34,926,258,176).
    assert (plan.slice, plan.need_bytes, plan.lora_bytes_per_gpu) == ("3g.40gb", 21_833_195_520, 1_477_705_728)
    # KV: 34,926,258,176 - 16,060,522,496 - 1,477,705,728 = 17,388,029,952 (18,865,735,680 without adapters),
    # // (4096 x 131,072) = 32 sequences (35 without).
    assert (plan.kv_cache_bytes_per_gpu, plan.max_concurrent_seqs) == (17_388_029_952, 32)


def test_plan_config_sizes_lora_buffers_from_the_models_lora_section(tmp_path):
    config = planned_models(tmp_path, llama=(LLAMA_3_8B, 1))
    entry = config.models[0].model_dump(mode="json")
    with_adapters = parse_config({"models": [{**entry, "lora": {"max_loras": 4, "max_lora_rank": 64}}]})
    [plain] = plan_config(config, gpu("h100-80gb"), MIG, PlanInputs())
    [adapted] = plan_config(with_adapters, gpu("h100-80gb"), MIG, PlanInputs())
    # The chart's kv_cache_memory_bytes leaves the buffers their room: vLLM allocates them beside an explicit KV pool.
    assert plain.kv_cache_bytes_per_gpu - adapted.kv_cache_bytes_per_gpu == 1_477_705_728


def test_a_speculative_draft_takes_its_weights_and_kv_from_the_replicas_memory(tmp_path):
    config = planned_models(tmp_path, llama=(LLAMA_3_8B, 1))
    entry = config.models[0].model_dump(mode="json")
    draft = folder(tmp_path, "llama-3.2-1b", LLAMA_3_2_1B)
    entry["engine_args"]["speculative_config"] = {"model": str(draft), "num_speculative_tokens": 4}
    [plain] = plan_config(config, gpu("h100-80gb"), MIG, PlanInputs())
    [drafted] = plan_config(parse_config({"models": [entry]}), gpu("h100-80gb"), MIG, PlanInputs())
    draft_weights = model_shape("d", draft).weight_bytes
    # 1,235,814,400 parameters (embedding tied) x 2 bytes (bf16).
    assert draft_weights == 2_471_628_800
    assert drafted.weight_bytes == plain.weight_bytes + draft_weights
    # KV per token: 131,072 for the 8B's 32 layers + 2 x 16 layers x 8 KV heads x 64 x 2 bytes = 32,768.
    assert (plain.kv_bytes_per_token, drafted.kv_bytes_per_token) == (131_072, 163_840)
    assert drafted.kv_cache_bytes_per_gpu == plain.kv_cache_bytes_per_gpu - draft_weights


def test_a_missing_draft_is_a_plan_error_naming_its_key(tmp_path):
    config = planned_models(tmp_path, llama=(LLAMA_3_8B, 1))
    entry = config.models[0].model_dump(mode="json")
    entry["engine_args"]["speculative_config"] = {"model": str(tmp_path / "nowhere"), "num_speculative_tokens": 4}
    with pytest.raises(PlanError, match=r"llama: engine_args\.speculative_config\.model: model source .* not found"):
        plan_config(parse_config({"models": [entry]}), gpu("h100-80gb"), MIG, PlanInputs())


def test_plan_config_reads_fully_sharded_loras_from_the_engine_args(tmp_path):
    config = planned_models(tmp_path, llama=(LLAMA_3_8B, 1))
    entry = config.models[0].model_dump(mode="json")
    lora = {"max_loras": 4, "max_lora_rank": 64}
    engine_args = {**entry["engine_args"], "tensor_parallel_size": 2}
    default, sharded = (plan_config(parse_config({"models": [{**entry, "lora": lora, "engine_args": {
        **engine_args, "extra": extra}}]}), gpu("h100-80gb"), WHOLE, PlanInputs())[0]
        for extra in ({}, {"fully_sharded_loras": True}))
    # Per layer, two ranks also halve A in q, k, v, gate, up (5 x 4,096 / 2) and B in o, down (2 x 4,096 / 2):
    # 14,336 fewer; x 32 layers x rank 64 x 4 slots x 2 bytes = 234,881,024 bytes less on each GPU.
    assert default.lora_bytes_per_gpu - sharded.lora_bytes_per_gpu == 234_881_024


# The tiny Llama: hidden 128, 2 heads of 64 and 1 KV head, MLP 256, vocab 2,048, 2 layers; rank 16 x 2 slots x 4 bytes.
# One rank, per layer: q 128+128, k and v 128+64 each, gate and up 128+256 each, o 128+128, down 256+128 = 2,048;
# x 2 layers = 4,096; embedding and LM head 2 x (2,048 + 128) = 4,352; 8,448 elements per rank of one slot.
# Two ranks, per layer: q's B halved 128+64, the one KV head copied to both ranks so k and v stay 128+64, gate and
# up 128+128, o's A halved 64+128, down's A halved 128+128 = 1,536; x 2 = 3,072, + 4,352 (whole) = 7,424.
# Fully sharded, two ranks also halve A in q, k, v, gate, up (5 x 64 fewer) and B in o, down (2 x 64 fewer):
# 1,536 - 448 = 1,088 per layer; x 2 = 2,176, + 4,352 = 6,528.
@pytest.mark.slow
@pytest.mark.parametrize(("num_ranks", "fully_sharded", "elements"), [(1, False, 8_448), (2, False, 7_424),
                                                                      (2, True, 6_528)])
def test_lora_buffers_are_the_bytes_vllm_allocates_on_each_rank(num_ranks, fully_sharded, elements):
    from fleetserve.platform.model_store import resolve_source

    pytest.importorskip("vllm")
    tiny = Path(resolve_source("tiny-random-llama"))
    expected = elements * 16 * 2 * 4
    slots = LoraSlots(2, 16, fully_sharded)
    assert model_shape("tiny", tiny, "float32").lora_bytes_per_rank(slots, num_ranks) == expected
    script = Path(__file__).with_name("lora_buffer_bytes.py")
    done = subprocess.run([sys.executable, str(script), str(tiny), "float32", "2", "16", str(num_ranks),
                           *(["fully_sharded"] if fully_sharded else [])], capture_output=True, text=True, timeout=300)
    line = [line for line in done.stdout.splitlines() if line.startswith("LORA_BYTES ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    assert [int(count) for count in line[0].split()[1:]] == [expected] * num_ranks


def test_kv_heads_are_split_between_ranks_and_copied_past_them(tmp_path):
    shape = model_shape("llama-3-70b", folder(tmp_path, "m", LLAMA_3_70B))
    # 80 layers x 2 (K and V) x 128 head dim x 2 bytes = 40,960 bytes per KV head per token; 8 KV heads.
    assert [shape.kv_bytes_per_token_per_rank(ranks) for ranks in (1, 2, 8, 16)] == [
        8 * 40_960, 4 * 40_960, 40_960, 40_960]


def test_sharding_needs_sizes_that_divide_the_attention_heads(tmp_path):
    # 9 heads: no size of 2, 4 or 8 divides them, so a model no GPU holds cannot be sharded either.
    odd = {**LLAMA_3_70B, "num_attention_heads": 9, "num_key_value_heads": 9, "head_dim": 128}
    with pytest.raises(PlanError, match=r"Nor does it fit sharded over up to 8 GPUs of one node .* its 9 attention"):
        plan_model(model_shape("odd", folder(tmp_path, "m", odd)), gpu("h100-80gb"), WHOLE, INPUTS)


def test_a_configured_tensor_parallel_size_is_kept_and_refused_on_mig(tmp_path):
    shape = model_shape("llama-3-8b", folder(tmp_path, "m", LLAMA_3_8B))
    # The 8B fits one H100, but the config asks for 2 ranks: the plan keeps them.
    plan = plan_model(shape, gpu("h100-80gb"), WHOLE, INPUTS, min_tensor_parallel_size=2)
    assert plan.tensor_parallel_size == 2
    with pytest.raises(PlanError, match="tensor_parallel_size 2, which needs whole GPUs"):
        plan_model(shape, gpu("h100-80gb"), MIG, INPUTS, min_tensor_parallel_size=2)


def plan_factory(model: str, slice_name: str, replicas: int = 1, need_bytes: int = GiB) -> ModelPlan:
    return ModelPlan(model, replicas, 0, need_bytes, 0, need_bytes, slice_name, 0, 0, 0.0, 0.0, 0.0, 0.0)


def test_packing_fills_one_all_balanced_h100():
    plans = [plan_factory("small", "1g.10gb", 2), plan_factory("mid", "2g.20gb"), plan_factory("big", "3g.40gb")]
    [only] = pack(plans, gpu("h100-80gb"))
    assert only.layout == "all-balanced"
    assert sorted(only.slots) == sorted([("1g.10gb", "small"), ("1g.10gb", "small"), ("2g.20gb", "mid"),
                                         ("3g.40gb", "big")])


def test_packing_uses_only_valid_layouts_and_places_every_replica():
    spec = gpu("a100-80gb")
    plans = [plan_factory("a", "3g.40gb", 3), plan_factory("b", "1g.10gb", 5), plan_factory("c", "4g.40gb")]
    gpus = pack(plans, spec)
    for assignment in gpus:
        assert tuple(profile for profile, _ in assignment.slots) == spec.layouts[assignment.layout]
    placed = [model for assignment in gpus for _, model in assignment.slots if model]
    assert sorted(placed) == sorted(["a"] * 3 + ["b"] * 5 + ["c"])
    # Optimal is 4: the 4g.40gb exists only in all-4g.40gb, alone on a GPU. Two GPUs hold at most
    # 3 of the 3g.40gb replicas with 2 of the 1g.10gb ones (all-3g.40gb + all-balanced), so the
    # other 3 small replicas need a third GPU for a and b.
    assert len(gpus) == 4


def test_every_mig_gpu_has_six_profiles_and_balanced_layout_fits_its_slices():
    assert sorted(name for name, spec in GPUS.items() if not spec.profiles) == ["l4-24gb", "l40s-48gb"]
    for spec in (spec for spec in GPUS.values() if spec.profiles):
        assert len(spec.profiles) == 6
        balanced = spec.layouts["all-balanced"]
        assert sum(spec.profile(p).num_compute_slices for p in balanced) <= 7
        assert sum(spec.profile(p).num_memory_slices for p in balanced) <= 8


def planned_models(tmp_path: Path, **models: tuple[dict, int]):
    """A platform config of models with these config.json shapes and replica counts, at 8 x 4096 tokens."""
    return parse_config({"models": [
        {"name": name, "source": str(folder(tmp_path, name, shape)), "replicas": replicas,
         "engine_args": {"max_model_len": 4096, "max_num_seqs": 8}} for name, (shape, replicas) in models.items()]})


def rendered_rayservice(values: dict) -> dict:
    """The RayService helm/fleetserve renders for these values."""
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(str(Path(__file__).resolve().parents[2] / "helm" / "fleetserve")) as chart:
        manifests = chart.render(values, name="demo", namespace="llm")
    return yaml.safe_load(manifests["fleetserve/templates/rayservice.yaml"])


def test_plan_config_emits_values_the_chart_accepts(tmp_path):
    config = planned_models(tmp_path, llama=(LLAMA_3_8B, 2), qwen=(QWEN2_7B, 1))
    spec = gpu("h100-80gb")
    plans = plan_config(config, spec, MIG, PlanInputs())
    assert [plan.slice for plan in plans] == ["3g.40gb", "3g.40gb"]  # qwen needs 17.1e9 > 2g.20gb's 16.9e9
    values = chart_values(config, plans, spec, MIG)
    assert values["workerGroups"] == {"colocated-3g-40gb": {
        "migProfile": "3g.40gb", "replicas": 3, "minReplicas": 0, "maxReplicas": 3, "cpu": "8", "memory": "32Gi"}}
    llama = values["platform"]["models"][0]
    assert llama["resources"] == {"num_gpus": 1, "custom_resources": {"mig-3g.40gb": 1}}
    # The KV pool is what the slice leaves: 34,926,258,176 - 16,060,522,496 = 18,865,735,680 bytes.
    assert llama["engine_args"]["kv_cache_memory_bytes"] == 18_865_735_680
    service = rendered_rayservice(values)
    served = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["platform"]
    assert parse_config(served).model("llama").resources.custom_resources == {"mig-3g.40gb": 1}


def test_small_models_take_parts_of_a_shared_gpu_without_mig(tmp_path):
    config = planned_models(tmp_path, qwen=(QWEN2_05B, 9), llama=(LLAMA_3_8B, 1))
    spec = gpu("l40s-48gb")
    qwen, llama = plan_config(config, spec, SHARED, PlanInputs())
    # Qwen2-0.5B: 494,032,768 params (tied head) x 2 B = 988,065,536 B of weights; KV 2 x 24 x 2 x 64 x 2 = 12,288
    # B a token, x 8 x 4096 = 402,653,184; need 1,390,718,720 <= an eighth's 6e9 x 0.9 - 1 GiB = 4,326,258,176.
    assert (qwen.slice, qwen.gpu_fraction, qwen.slice_usable_bytes) == ("gpu/8", 0.125, 4_326_258_176)
    # Llama-3-8B needs 20,355,489,792 <= a half's 24e9 x 0.9 - 1 GiB = 20,526,258,176 (a quarter's 9.7e9 is short).
    assert (llama.slice, llama.gpu_fraction) == ("gpu/2", 0.5)
    # Halvings pack exactly: the half and four eighths fill one GPU, the other five eighths the next.
    assert [(gpu_.layout, gpu_.slots) for gpu_ in pack([qwen, llama], spec)] == [
        ("shared", [("gpu/2", "llama")] + [("gpu/8", "qwen")] * 4),
        ("shared", [("gpu/8", "qwen")] * 5 + [("3/8 free", None)])]
    values = chart_values(config, [qwen, llama], spec, SHARED)
    # 9 x 1/8 + 1/2 = 1.625 GPUs: two one-GPU pods.
    assert values["workerGroups"] == {"colocated-shared-gpu": {
        "migProfile": "", "replicas": 2, "minReplicas": 0, "maxReplicas": 2, "cpu": "8", "memory": "32Gi"}}
    entry = values["platform"]["models"][0]
    # The KV pool is what the eighth leaves: 4,326,258,176 - 988,065,536 = 3,338,192,640 bytes.
    assert entry["resources"] == {"num_gpus": 0.125}
    assert entry["engine_args"]["kv_cache_memory_bytes"] == 3_338_192_640
    served = yaml.safe_load(rendered_rayservice(values)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert parse_config(served["platform"]).model("qwen").resources.num_gpus == 0.125


def test_a_gpu_without_mig_refuses_a_mig_plan(tmp_path):
    with pytest.raises(PlanError, match="l4-24gb has no MIG; plan it with --shared"):
        plan_model(model_shape("q", folder(tmp_path, "q", QWEN2_05B)), gpu("l4-24gb"), MIG, INPUTS)


def test_plan_json_on_stdout_is_the_json_alone(tmp_path):
    from typer.testing import CliRunner

    from fleetserve.cli.main import app

    path = tmp_path / "platform.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "llama", "source": str(folder(tmp_path, "llama", LLAMA_3_8B)),
                                                "engine_args": {"max_model_len": 4096, "max_num_seqs": 8}}]}))
    result = CliRunner().invoke(app, ["plan", str(path), "--mig", "--json", "-"])
    assert result.exit_code == 0, result.output
    # The tables went to stderr; before, they came first on stdout and the JSON did not parse.
    plan = json.loads(result.stdout)
    assert [model["slice"] for model in plan["models"]] == ["3g.40gb"]
    assert "capacity plan on h100-80gb" in result.stderr


def test_emitted_profiles_replay_in_the_simulator(tmp_path):
    from typer.testing import CliRunner

    from fleetserve.cli.main import app

    path = tmp_path / "platform.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "llama", "source": str(folder(tmp_path, "llama", LLAMA_3_8B)),
                                                "engine_args": {"max_model_len": 4096, "max_num_seqs": 8}}]}))
    result = CliRunner().invoke(app, ["plan", str(path), "--mig", "--emit-profiles", str(tmp_path / "profiles")])
    assert result.exit_code == 0, result.output
    profile = yaml.safe_load((tmp_path / "profiles" / "llama.yaml").read_text())
    assert (profile["kv_capacity_tokens"], profile["max_num_seqs"]) == (143_934, 8)  # the slice's KV; the config's
    policy = tmp_path / "policy.yaml"
    policy.write_text("policy: ray_default\nmin_replicas: 1\nmax_replicas: 2\n")
    summary = tmp_path / "summary.json"
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", "ramp:60:1:2", "--policy", str(policy),
                                      "--profile", str(tmp_path / "profiles" / "llama.yaml"), "--json", str(summary)])
    assert result.exit_code == 0, result.output
    assert json.loads(summary.read_text())["profile"] == profile


def test_a_sharded_model_gets_a_group_whose_pods_hold_all_its_gpus(tmp_path):
    config = planned_models(tmp_path, big=(LLAMA_3_70B, 2), small=(LLAMA_3_8B, 1))
    spec = gpu("h100-80gb")
    values = chart_values(config, plan_config(config, spec, WHOLE, PlanInputs()), spec, WHOLE)
    # Host memory: 1.5 x 141,107,412,992 bytes of weights = 197.1 GiB, rounded up to 198.
    assert values["workerGroups"] == {
        "colocated-4gpu": {"migProfile": "", "replicas": 2, "minReplicas": 0, "maxReplicas": 2, "cpu": "8",
                           "memory": "198Gi", "numGpus": 4},
        "colocated-gpu": {"migProfile": "", "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "cpu": "8",
                          "memory": "32Gi"}}
    big = parse_config(values["platform"]).model("big")
    assert (big.engine_args.tensor_parallel_size, big.resources.num_gpus) == (4, 4)
    assert big.engine_args.kv_cache_memory_bytes == 35_649_404_928  # per GPU, as vLLM reads it
    assert parse_config(values["platform"]).model("small").engine_args.tensor_parallel_size == 1
    specs = rendered_rayservice(values)["spec"]["rayClusterConfig"]
    gpus = {group["groupName"]: group["rayStartParams"]["num-gpus"] for group in specs["workerGroupSpecs"]}
    assert gpus == {"colocated-4gpu": "4", "colocated-gpu": "1"}


def test_a_disaggregated_model_that_needs_sharding_is_refused(tmp_path):
    config = parse_config({"models": [{"name": "big", "source": str(folder(tmp_path, "b", LLAMA_3_70B)),
                                       "engine_args": {"max_model_len": 4096, "max_num_seqs": 8},
                                       "disaggregation": {"prefill": {}, "decode": {}}}]})
    with pytest.raises(PlanError, match="big needs 4 GPUs per replica .* disaggregated models do not support yet"):
        plan_config(config, gpu("h100-80gb"), WHOLE, PlanInputs())


def test_disaggregated_model_plans_both_pools_on_one_group(tmp_path):
    config = parse_config({"models": [
        {"name": "llama", "source": str(folder(tmp_path, "l", LLAMA_3_8B)),
         "engine_args": {"max_model_len": 4096, "max_num_seqs": 8},
         "resources": {"cpu_binding": ["0-3"]},
         "disaggregation": {"prefill": {"replicas": 1, "cpu_binding": ["0"]},
                            "decode": {"replicas": 2, "cpu_binding": ["1"],
                                       "autoscaling": {"min_replicas": 1, "max_replicas": 4}}}}]})
    spec = gpu("h100-80gb")
    plans = plan_config(config, spec, MIG, PlanInputs())
    # 1 prefill + at most 4 decode replicas, each on its own 3g.40gb slice.
    assert [(plan.slice, plan.replicas) for plan in plans] == [("3g.40gb", 5)]
    values = chart_values(config, plans, spec, MIG)
    # Starts with 1 prefill + 2 decode pods; grows to 5.
    assert values["workerGroups"] == {"disaggregated-3g-40gb": {
        "migProfile": "3g.40gb", "replicas": 3, "minReplicas": 0, "maxReplicas": 5, "cpu": "8", "memory": "32Gi"}}
    # A CPU host's core pins, the model's and each pool's, do not travel to GPU nodes.
    llama = values["platform"]["models"][0]
    assert "cpu_binding" not in llama["resources"]
    # (The values hold only what differs from the defaults: one prefill replica, autoscaling from 1 to 4.)
    assert llama["disaggregation"]["prefill"] == {}
    assert llama["disaggregation"]["decode"] == {"replicas": 2, "autoscaling": {}}
    pools = parse_config(values["platform"]).model("llama").disaggregation
    assert (pools.prefill.cpu_binding, pools.decode.cpu_binding) == (None, None)
    assert (pools.decode.autoscaling.min_replicas, pools.decode.autoscaling.max_replicas) == (1, 4)


def test_models_that_start_at_zero_start_their_worker_group_with_no_pod(tmp_path):
    zero = {"replicas": 0, "autoscaling": {"policy": "kv_cache", "min_replicas": 0, "max_replicas": 2}}
    config = parse_config({"models": [
        {"name": name, "source": str(folder(tmp_path, name, LLAMA_3_8B)),
         "engine_args": {"max_model_len": 4096, "max_num_seqs": 8}, **zero} for name in ("ft-a", "ft-b")]})
    spec = gpu("h100-80gb")
    values = chart_values(config, plan_config(config, spec, MIG, PlanInputs()), spec, MIG)
    # No pod until a model wakes; KubeRay's autoscaler adds one per woken replica, up to 2 + 2.
    assert values["workerGroups"] == {"colocated-3g-40gb": {
        "migProfile": "3g.40gb", "replicas": 0, "minReplicas": 0, "maxReplicas": 4, "cpu": "8", "memory": "32Gi"}}
    assert [model["replicas"] for model in values["platform"]["models"]] == [0, 0]
