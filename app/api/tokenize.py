"""vLLM's tokenizer endpoints, for clients that count tokens themselves (lm-eval's
``local-completions`` with ``tokenizer_backend=remote`` measures contexts with them):

    POST /tokenize        {"prompt": str, "add_special_tokens": true, "model"?: str}
                          -> {"count", "max_model_len", "tokens"}: the ids /v1/completions
                          gives the same text (with add_special_tokens, BOS first)
    POST /detokenize      {"tokens": [int], "model"?: str} -> {"prompt": str} (special tokens
                          kept, so their spellings tokenize back to them)
    GET  /tokenizer_info  {"tokenizer_class", "bos_token", "eos_token", "model_max_length"}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import deepseek_recipe as dr
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from app.api.errors import ApiError


class _Model(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str | None = None  # when given, a served model


class TokenizeBody(_Model):
    prompt: str
    add_special_tokens: bool = True


class DetokenizeBody(_Model):
    tokens: list[Annotated[int, Field(ge=0)]]


class TokenizerFrontend:
    """The tokenizer endpoints of one served model (``bos``: its BOS id, None if it has
    none)."""

    def __init__(
        self, tokenizer: Tokenizer, bos: int | None, served: list[str], context_limit: int
    ) -> None:
        self.tokenizer, self.bos = tokenizer, bos
        self.served, self.context_limit = served, context_limit
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def tokenize(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        body = self._parse(TokenizeBody, raw)
        ids = self.tokenizer.encode_batch([body.prompt], add_special_tokens=False)[0].ids
        if body.add_special_tokens and self.bos is not None:
            ids = [self.bos, *ids]
        return {"count": len(ids), "max_model_len": self.context_limit, "tokens": ids}

    def detokenize(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        body = self._parse(DetokenizeBody, raw)
        if body.tokens and (hi := max(body.tokens)) >= self.vocab_size:
            raise ApiError(400, f"tokens: token id {hi} >= vocab size {self.vocab_size}",
                           param="tokens")  # fmt: skip
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def info(self) -> dict[str, Any]:
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": dr.SpecialToken.Bos.default_str() if self.bos is not None else None,
            "eos_token": dr.SpecialToken.Eos.default_str(),
            "model_max_length": self.context_limit,
        }

    def _parse(self, cls: type[_Model], raw: Mapping[str, Any]) -> Any:
        try:
            body = cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            param = str(err["loc"][0]) if err["loc"] else None
            raise ApiError(400, f"{loc}: {err['msg']}", param=param) from None
        if body.model is not None and body.model not in self.served:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; served models: {', '.join(self.served)}",
                param="model",
                code="model_not_found",
            )
        return body
