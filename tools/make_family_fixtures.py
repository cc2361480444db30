"""Write transformers' outputs for the tiny random models of each family jaxserve serves beside Llama
(tests/tiny_models.py builds them, the same from its seed on any machine), for tests/models/test_families.py:

    .venv/bin/pip install -e '.[reference]'
    .venv/bin/python tools/make_family_fixtures.py      # writes tests/fixtures/{families,spm}_reference.json

Recorded in float32, per family and tied / untied embeddings: the prompt's token ids, each position's logprob of
the next prompt token and the 5 most likely, 12 greedy tokens with each step's two best logprobs (a tie may go
either way), and the family's chat template as transformers renders 10 conversations. Beside them, a SentencePiece
GGUF vocabulary (tiny_models.write_spm_gguf) as transformers tokenizes and decodes tiny_models.SPM_TEXTS, for
the llama, phi3 and gemma3 architectures (tests/models/test_tokenizer.py). For Gemma 3, also its image-text model's
logprobs on the prompt (tiny_models.as_image_text: the same text weights as gemma-3-4b and larger keep them); for
Phi-3, RoPE's cos and sin past the original context (LongRoPE's long factors); for Qwen2, a YaRN model's logprobs
and greedy tokens on a prompt past its original context, dynamic NTK's cos and sin at 4x the context, and YaRN's
frequencies for long-context checkpoints' settings.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from jaxserve.models import registry  # noqa: E402
from jaxserve.models.gguf_loader import GGUFFile  # noqa: E402
from jaxserve.models.tokenizer import TextTokenizer  # noqa: E402
from tiny_models import (  # noqa: E402
    CONVERSATIONS,
    DYNAMIC,
    DYNAMIC_POSITIONS,
    FAMILIES,
    PHI3_LONG_POSITIONS,
    PROMPT,
    SPM_TEXTS,
    YARN,
    YARN_CONFIGS,
    YARN_PROMPT,
    as_image_text,
    write_spm_gguf,
    write_tiny_model,
)

OUT = ROOT / "tests" / "fixtures" / "families_reference.json"
SPM_OUT = ROOT / "tests" / "fixtures" / "spm_reference.json"
GREEDY = 12


def record(root: pathlib.Path, ids: list[int]) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        top = lp.topk(5, -1)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False, pad_token_id=0
        )[0].tolist()
        steps = torch.log_softmax(model(torch.tensor([out])).logits[0].double(), -1)[len(ids) - 1 : -1].topk(2, -1)
    return {
        "chosen": [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)],
        "top_ids": top.indices[:-1].tolist(),
        "top": top.values[:-1].tolist(),
        "greedy": out[len(ids) :],
        "greedy_top2": steps.values.tolist(),
    }


def image_text(root: pathlib.Path, ids: list[int]) -> list[float]:
    """Each position's logprob of the next prompt token from an image-text Gemma 3 folder, on text alone."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(root), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def rope_at(root: pathlib.Path, positions: list[int]) -> dict:
    """transformers' RoPE cos and sin at `positions`, one forward's (Phi-3's LongRoPE past the original context takes
    its long factors; dynamic NTK's base follows the last position)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, 1, 16), torch.tensor([positions]))
    return {"cos": cos[0].tolist(), "sin": sin[0].tolist()}


def yarn_frequencies() -> dict:
    """transformers' YaRN inverse frequencies and attention factor for long-context checkpoints' settings."""
    out = {}
    for name, settings in YARN_CONFIGS.items():
        config = transformers.AutoConfig.for_model(**settings)
        inv, attention = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        out[name] = {"inv_freq": inv.tolist(), "attention_factor": attention}
    return out


def record_spm() -> dict:
    out = {}
    for arch in ("llama", "phi3", "gemma3"):
        with tempfile.TemporaryDirectory() as d:
            write_spm_gguf(pathlib.Path(d) / "spm.gguf", arch)
            theirs = transformers.AutoTokenizer.from_pretrained(d, gguf_file="spm.gguf")
            out[arch] = [
                {
                    "text": t,
                    "ids": theirs.encode(t, add_special_tokens=False),
                    "with_bos": theirs.encode(t)[:1] == [theirs.bos_token_id],
                    "decoded": theirs.decode(theirs.encode(t, add_special_tokens=False), skip_special_tokens=True),
                }
                for t in SPM_TEXTS
            ]
    return out


def main() -> None:
    SPM_OUT.write_text(json.dumps(record_spm(), indent=1, ensure_ascii=False))
    print(f"wrote {SPM_OUT}")
    tokenizer = TextTokenizer.from_gguf(GGUFFile(registry.resolve(registry.DEFAULT_MODEL)))
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    fixture = {}
    for family, template in FAMILIES.items():
        entry: dict = {"ids": ids}
        for tied in (True, False):
            with tempfile.TemporaryDirectory() as d:
                write_tiny_model(pathlib.Path(d), tokenizer, family=family, tied=tied, chat_template=template)
                entry["tied" if tied else "untied"] = record(pathlib.Path(d), ids)
                theirs = transformers.AutoTokenizer.from_pretrained(d)
                entry["chat"] = [
                    theirs.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVERSATIONS
                ]
        if family == "phi3":  # RoPE's cos and sin past the original context (LongRoPE's long factors)
            with tempfile.TemporaryDirectory() as d:
                write_tiny_model(pathlib.Path(d), tokenizer, family=family)
                entry["long_rope"] = rope_at(pathlib.Path(d), PHI3_LONG_POSITIONS)
        if family == "qwen2":  # YaRN past its original context; dynamic NTK's RoPE at factor x the context
            entry["yarn_ids"] = tokenizer.encode(YARN_PROMPT, add_special_tokens=False)
            with tempfile.TemporaryDirectory() as d:
                write_tiny_model(pathlib.Path(d), tokenizer, family=family, rope=YARN)
                entry["yarn"] = record(pathlib.Path(d), entry["yarn_ids"])
            with tempfile.TemporaryDirectory() as d:
                write_tiny_model(pathlib.Path(d), tokenizer, family=family, rope=DYNAMIC)
                entry["dynamic_rope"] = rope_at(pathlib.Path(d), DYNAMIC_POSITIONS)
            entry["yarn_frequencies"] = yarn_frequencies()
        if family == "gemma3":  # Gemma3ForConditionalGeneration on text (tiny_models.as_image_text)
            with tempfile.TemporaryDirectory() as d:
                write_tiny_model(pathlib.Path(d), tokenizer, family=family, tied=True)
                as_image_text(pathlib.Path(d))
                entry["image_text"] = image_text(pathlib.Path(d), ids)
        fixture[family] = entry
    OUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
