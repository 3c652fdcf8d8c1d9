"""vLLM's /tokenize and /detokenize bodies -> their replies, with the served model's tokenizer.

/tokenize takes a completion prompt ({"prompt": text, "add_special_tokens": true}) or chat
messages rendered with the chat template ({"messages": [...], "add_special_tokens": false, and
the chat route's template fields}); it answers {"count", "max_model_len", "tokens", "token_strs"}
(token_strs only when return_token_strs is true, else null). /detokenize takes {"tokens": [...]}
and answers {"prompt": text}, for at most the context's tokens (max_model_len). Bad input is an
ApiError (400), as for the OpenAI routes. A text past the context is counted, up to
MAX_TOKENIZE_CONTEXTS contexts' tokens; past that, or with more characters than the context's
tokens could stand for, it is a 400 (tokenizing MiBs holds a gateway thread for seconds and
takes hundreds of MiB; rare characters are several tokens each, so 660k characters were 2.5M
tokens and a 38 MB reply).
"""

from __future__ import annotations

from pd_serve.gateway.openai_protocol import (CHAT_TEMPLATE_FIELDS, ApiError, ModelInfo, _is_int,
                                              _json_type, _messages, _opt, check_chars,
                                              model_not_found, render_chat)

_TOKENIZE_FIELDS = frozenset(("model", "prompt", "messages", "add_special_tokens",
                              "return_token_strs")) | CHAT_TEMPLATE_FIELDS
_DETOKENIZE_FIELDS = frozenset(("model", "tokens"))
MAX_TOKENIZE_CONTEXTS = 4


def tokenize(body, model: ModelInfo) -> dict:
    body = _check(body, model, _TOKENIZE_FIELDS)
    tokenizer = model.tokenizer
    if ("prompt" in body) == ("messages" in body):
        raise ApiError("give either 'prompt' or 'messages'", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise ApiError(f"'prompt' must be a string, got {_json_type(body['prompt'])}", "prompt")
        special = _opt(body, "add_special_tokens", bool)
        ids = _counted(body["prompt"], model, "prompt", True if special is None else special)
    else:
        text = render_chat(body, model, _messages(body["messages"]))
        ids = _counted(text, model, "messages", bool(_opt(body, "add_special_tokens", bool)))
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] \
        if _opt(body, "return_token_strs", bool) else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def _counted(text: str, model: ModelInfo, what: str, special: bool) -> list[int]:
    """The text's ids, or a 400 past MAX_TOKENIZE_CONTEXTS contexts' tokens: judged by as many
    leading characters first (a token spans at least part of one), so a text of rare
    characters is refused before the rest of it is tokenized."""
    check_chars(text, model, what)
    if model.max_model_len is None:
        return model.tokenizer.encode(text, add_special_tokens=special)
    most = MAX_TOKENIZE_CONTEXTS * model.max_model_len

    def refuse(ids: list[int], whose: str) -> ApiError:
        return ApiError(f"{whose} tokenized to {len(ids)} tokens; /tokenize counts at most {most} "
                        f"({MAX_TOKENIZE_CONTEXTS} x the context's {model.max_model_len})", what)
    if len(text) > most:
        head = model.tokenizer.encode(text[:most], add_special_tokens=special)
        if len(head) > most:
            raise refuse(head, f"the first {most} characters of your {what}")
    ids = model.tokenizer.encode(text, add_special_tokens=special)
    if len(ids) > most:
        raise refuse(ids, f"your {what}")
    return ids


def detokenize(body, model: ModelInfo) -> dict:
    body = _check(body, model, _DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    vocab = model.tokenizer.vocab_size
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise ApiError("'tokens' must be a list of token ids", "tokens")
    limit = model.max_model_len
    if limit is not None and len(ids) > limit:  # the tokenizer's decode holds the GIL: 5.6M ids
        # (a 32 MiB body) held every thread and the event loop for 10 s, into ~450M characters
        raise ApiError(f"{len(ids)} tokens; at most the model's context ({limit}) per request",
                       "tokens")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)}


def _check(body, model: ModelInfo, fields: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_json_type(body)}")
    name = body.get("model")
    if name is not None and name != model.name:
        raise model_not_found(name, model.name)
    for key, value in body.items():
        if key not in fields and value is not None:
            raise ApiError(f"'{key}' is not supported by this server", key)
    return body
