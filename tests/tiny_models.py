"""Small random-weight models written as Hugging Face folders, for tests that need a real tokenizer."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from jaxserve.models import registry
from jaxserve.models.gguf_loader import GGUFFile
from jaxserve.models.tokenizer import TextTokenizer


# Qwen2.5's chat template (its system default, turns in ChatML)
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x3?"}],
    [{"role": "user", "content": "Ünïcode ✓ and emoji 🙂"}],
    [{"role": "user", "content": "Line one\nLine two\n\n  indented"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
    [{"role": "user", "content": "{{ not a template }} {% raw %}"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ],
    [{"role": "user", "content": "quotes ' \" and \\ backslash"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "<|im_end|> typed by a user"}],
]
# Mistral-7B-Instruct-v0.3's (a system message goes before the first user turn)
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system %}{{- '[INST] ' + system + '\n\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)
# Phi-3-mini's
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Qwen3's (its thinking turns, tool calls and responses in ChatML)
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
# Gemma 3's (google/gemma-3-1b-it: the system message opens the first user turn; the assistant is "model")
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
PROMPT = "The quick brown fox jumps over the lazy dog. 12345"
# family -> its chat template (tools/fixtures/families.py records transformers' side in a fixture)
FAMILIES = {
    "qwen2": QWEN_TEMPLATE,
    "qwen3": QWEN3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
    "phi3": PHI3_TEMPLATE,
    "gemma3": GEMMA3_TEMPLATE,
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
WINDOW = 6  # the sliding window here (Mistral, Phi-3, Gemma 3's first layer): shorter than the test's text
# Phi-3's LongRoPE as its 128K variants configure it (here 4,096 tokens stretched to 16,384): a factor per frequency
PHI3_ROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.2, 1.5, 2.1, 3.0, 4.4, 6.5, 9.6, 14.0],
}
PHI3_CONTEXT, PHI3_ORIGINAL = 16384, 4096
PHI3_LONG_POSITIONS = [4096, 4097, 4500, 5000]  # past the original context: the long factors


def smollm2_tokenizer() -> TextTokenizer:
    """The default model's tokenizer (SmolLM2's), read from its GGUF: the real one for the tiny random models."""
    return TextTokenizer.from_gguf(GGUFFile(registry.resolve(registry.DEFAULT_MODEL)))


def phi3_rope_tensors() -> dict[str, np.ndarray]:
    """PHI3_ROPE's factors as llama.cpp's converter writes them into a GGUF file."""
    return {f"rope_factors_{k}.weight": np.asarray(PHI3_ROPE[f"{k}_factor"], np.float32) for k in ("long", "short")}


# Qwen2.5's YaRN as its model card adds it (max_position_embeddings left at the original context), here 64 tokens
# stretched 4 times; the prompt runs past the original context
YARN_ORIGINAL, YARN_FACTOR = 64, 4.0
YARN = {
    "rope_scaling": {"type": "yarn", "factor": YARN_FACTOR, "original_max_position_embeddings": YARN_ORIGINAL},
    "max_position_embeddings": YARN_ORIGINAL,
}
YARN_PROMPT = " ".join([PROMPT] * 8)
# dynamic NTK: transformers' base at a forward reaching factor x the context, where vLLM fixes it
DYNAMIC = {"rope_scaling": {"type": "dynamic", "factor": YARN_FACTOR}, "max_position_embeddings": YARN_ORIGINAL}
DYNAMIC_POSITIONS = [0, 1, 63, 64, 200, 255]  # one forward whose last position is factor x 64 - 1
# long-context checkpoints' YaRN settings, for transformers' inverse frequencies and attention factor
YARN_CONFIGS = {
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "head_dim": 128,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
    "mscale-betas": {
        "model_type": "llama",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "rope_theta": 5e5,
        "max_position_embeddings": 65536,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    },
}
# Gemma 3's settings beside the shared shape: every one differs from its default, so each matters
GEMMA3 = {
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 0.5,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    },
}


# The cluster tests' model (tests/cluster, tests/test_multihost.py): its 6 query and 3 KV heads split over 3
# tensor-parallel devices, its 4 layers over 2 pipeline stages.
CLUSTER_MODEL = dict(layers=4, heads=6, kv_heads=3, mlp=192)


def write_tiny_model(
    root: pathlib.Path,
    tokenizer: TextTokenizer,
    seed: int = 0,
    family: str = "llama",
    tied: bool = True,
    chat_template: str | None = None,
    rope: dict | None = None,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    mlp: int = 128,
) -> dict[str, np.ndarray]:
    """A model of random weights (`layers` layers of `heads` query and `kv_heads` KV heads of 16, `mlp` MLP
    features) with `tokenizer`, as a Hugging Face folder; its tensors by name. Beside
    "llama": "qwen2" (q/k/v biases), "qwen3" (q/k norms), "mistral" (a sliding window), "phi3" (fused q/k/v and gate/up projections,
    a sliding window, LongRoPE) and "gemma3" (GEMMA3: a sliding layer and a full one, q/k norms, four norms a layer), each
    with its family's RoPE theta and its norms drawn (so every weight matters). rope: config.json's keys over the
    family's (YARN, DYNAMIC)."""
    v, h, f, d = tokenizer.vocab_size, 64, mlp, 16
    qwen2, llama, gemma3 = family == "qwen2", family == "llama", family == "gemma3"
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731

    def norm(n: int = h) -> np.ndarray:  # Gemma's scale by 1 + weight
        return (np.ones(n) if llama else (0 if gemma3 else 1) + 0.3 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(heads * d, h),
            p + "self_attn.k_proj.weight": w(kv_heads * d, h),
            p + "self_attn.v_proj.weight": w(kv_heads * d, h),
            p + "self_attn.o_proj.weight": w(h, heads * d),
            p + "mlp.gate_proj.weight": w(f, h),
            p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
        }
        if qwen2:
            tensors |= {
                p + f"self_attn.{x}_proj.bias": (0.3 * rng.standard_normal(n)).astype(np.float32)
                for x, n in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d))
            }
        if gemma3 or family == "qwen3":
            tensors |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
        if gemma3:
            tensors |= {p + "pre_feedforward_layernorm.weight": norm(), p + "post_feedforward_layernorm.weight": norm()}
    if not tied:
        tensors["lm_head.weight"] = w(v, h)
    if family == "phi3":  # q, k, v as one projection, gate and up as another
        for i in range(layers):
            p = f"model.layers.{i}."
            tensors[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [tensors.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
            )
            tensors[p + "mlp.gate_up_proj.weight"] = np.concatenate(
                [tensors.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
            )
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"))
    config = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": "gemma3_text" if gemma3 else family,
        "vocab_size": v,
        "hidden_size": h,
        "intermediate_size": f,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": d,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6 if family in ("qwen2", "qwen3", "gemma3") else 1e-5,
        "rope_theta": 1e6 if family in ("qwen2", "qwen3", "mistral") else 10000.0,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        **({"sliding_window": WINDOW} if family in ("mistral", "phi3", "gemma3") else {}),
        **(GEMMA3 if gemma3 else {}),
    }
    if family == "phi3":
        config |= {
            "rope_scaling": PHI3_ROPE,
            "max_position_embeddings": PHI3_CONTEXT,
            "original_max_position_embeddings": PHI3_ORIGINAL,
        }
    (root / "config.json").write_text(json.dumps(config | (rope or {})))
    tokenizer.tokenizer.save(str(root / "tokenizer.json"))
    special = {"eos_token": tokenizer.special_tokens["eos_token"], "bos_token": None}
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                **special,
                **({"chat_template": chat_template} if chat_template else {}),
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return tensors


def as_image_text(root: pathlib.Path, prefix: str = "language_model.model.") -> None:
    """The Hugging Face folder of a tiny "gemma3" model rewritten as Gemma 3's image-text checkpoints are laid out
    (gemma-3-4b and larger): its config as text_config beside a (tiny) vision tower's, its tensors under `prefix`
    (the hub's files: language_model.model.; transformers 5 saves model.language_model.). The vision tower's
    weights are left out: transformers draws them, and text alone never reads them."""
    from safetensors.numpy import load_file

    text = json.loads((root / "config.json").read_text())
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    (root / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gemma3",
                "architectures": ["Gemma3ForConditionalGeneration"],
                "text_config": text,
                "vision_config": vision,
                "mm_tokens_per_image": 4,
                "torch_dtype": "float32",
            }
        )
    )
    tensors = load_file(str(root / "model.safetensors"))
    save_file({prefix + k.removeprefix("model."): v for k, v in tensors.items()}, str(root / "model.safetensors"))


def gguf_tensors(tensors: dict[str, np.ndarray], arch: str, heads: int = 4, kv_heads: int = 2) -> dict[str, np.ndarray]:
    """Hugging Face-named tensors by llama.cpp's names, as its converter writes them for `arch`: llama's q and k
    rows permuted (interleaved RoPE pairs), phi3's fused projections as they are, gemma3's norms as 1 + weight."""
    gemma3 = arch == "gemma3"
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight" if gemma3 else "ffn_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
        **{f"self_attn.{x}_proj.{kind}": f"attn_{x}.{kind}" for x in "qkv" for kind in ("weight", "bias")},
    }
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    out = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if arch == "llama" and parts[-2] in ("q_proj", "k_proj"):
            n = heads if parts[-2] == "q_proj" else kv_heads
            value = value.reshape(n, 2, value.shape[0] // n // 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
        if gemma3 and key.endswith("norm.weight"):
            value = value + np.float32(1.0)
        out[top[key] if key in top else f"blk.{parts[2]}.{names['.'.join(parts[3:])]}"] = value
    return out


def write_gguf(
    path: pathlib.Path,
    arch: str,
    config: dict,
    tensors: dict[str, np.ndarray],
    tokenizer: TextTokenizer,
    pre: str,
    qtype: str | None = None,
) -> None:
    """A GGUF file as llama.cpp's converter writes one: `config` its `{arch}.*` metadata, `tensors` by their GGUF
    names ([out, in] arrays), the tokenizer's byte-level BPE vocabulary and merges, `pre` its pre-tokenizer. Float32,
    or with `qtype` (a block type the gguf package quantizes: Q4_0, Q4_1, Q8_0, ...) every matrix in its blocks,
    as llama-quantize leaves the norms float32."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in config.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    spec = json.loads(tokenizer.tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [""] * tokenizer.vocab_size
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    for t in spec["added_tokens"]:
        tokens[t["id"]] = t["content"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    eos = tokenizer.tokenizer.token_to_id(tokenizer.special_tokens["eos_token"])
    w.add_eos_token_id(eos)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, np.float32)
        if qtype is None or array.ndim < 2:
            w.add_tensor(name, array)
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(array, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# A SentencePiece ("llama") vocabulary, as llama.cpp's converter writes Llama-2, Mistral and Phi-3 models: <unk>,
# <s>, </s>, the 256 byte tokens, then pieces ("▁" marks a space) scored best first. Its merges are implied.
SPM_PIECES = [
    "▁",
    "e",
    "t",
    "a",
    "o",
    "i",
    "n",
    "s",
    "h",
    "r",
    "l",
    "d",
    "u",
    "c",
    "m",
    "w",
    "f",
    "g",
    "y",
    "p",
    ",",
    ".",
    "T",
    "I",
    "W",
    "!",
    "?",
    "1",
    "2",
    "3",
    "th",
    "he",
    "in",
    "er",
    "an",
    "▁t",
    "▁a",
    "▁s",
    "▁w",
    "on",
    "▁th",
    "▁the",
    "en",
    "at",
    "re",
    "is",
    "▁i",
    "▁is",
    "or",
    "ou",
    "it",
    "▁o",
    "▁of",
    "ing",
    "▁in",
    "ll",
    "ed",
    "▁h",
    "▁he",
    "▁b",
    "▁c",
    "ar",
    "▁m",
    "▁f",
    "▁d",
    "▁p",
    "es",
    "▁The",
    "▁T",
    "he▁",
    "▁▁",
    "▁▁▁",
]
SPM_TEXTS = [
    "The cat sat on the mat.",
    " leading space",
    "two  spaces and   three",
    "line\nbreak\n\nend",
    "unicode: café, naïve, 日本語 ✓",
    "<s>inside</s> control",
    "What is it? It is 123!",
    "",
    " ",
    "▁raw marker",
]


def write_spm_gguf(path: pathlib.Path, arch: str, extra: tuple[str, ...] = ()) -> None:
    """A GGUF file holding only metadata and the SentencePiece vocabulary above (no weights: a tokenizer's test),
    with `extra` user-defined tokens last. For gemma3, tokens of two or more spaces spelled with spaces, as
    Gemma's files have them."""
    import gguf

    pieces = [p.replace("▁", " ") if arch == "gemma3" and not p.strip("▁") and len(p) > 1 else p for p in SPM_PIECES]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + list(extra)
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4] * len(extra)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0] * len(extra)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
