"""The oracle: what PEFT (or the plain base model) generates for one request alone."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from peft import PeftModel
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast


class Reference:
    def __init__(self, base_dir: Path, tokenizer_dir: Path) -> None:
        self.base_dir = base_dir
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
        self._models: dict[Path | None, torch.nn.Module] = {}

    def _model(self, adapter_dir: Path | None) -> torch.nn.Module:
        if adapter_dir not in self._models:
            base = LlamaForCausalLM.from_pretrained(str(self.base_dir), use_safetensors=True)
            model = base if adapter_dir is None else PeftModel.from_pretrained(base,
                                                                               str(adapter_dir))
            self._models[adapter_dir] = model.eval()
        return self._models[adapter_dir]

    @lru_cache(maxsize=512)  # noqa: B019 - one Reference per session; bounded
    def generate(self, prompt: str, adapter_dir: Path | None, max_tokens: int) -> str:
        tok = self.tokenizer
        ids = tok(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        input_ids = torch.tensor([[tok.bos_token_id, *ids]])
        with torch.inference_mode():
            out = self._model(adapter_dir).generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        new = out[0, input_ids.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        return str(tok.decode(new, skip_special_tokens=True))
