"""Write a weightless tiny-Llama model directory for Dynamo's mocker (run with .venv-dynamo's
python: it needs the ``tokenizers`` package, which kvrelay does not depend on)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 1001  # tokens t0 .. t1000


def write(out: Path) -> None:
    from tokenizers import (  # type: ignore[import-not-found]  # .venv-dynamo only
        Tokenizer,
        models,
        pre_tokenizers,
    )

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float16", "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False,
    }, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "max_length": 4096})
    )
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1",
        "unk_token": "t0", "model_max_length": 4096,
    }))


if __name__ == "__main__":
    write(Path(sys.argv[1]))
