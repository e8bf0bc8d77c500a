"""The worker's runtime tokenizer: Hugging Face model dirs without `transformers`.

A model dir from the Hub carries `tokenizer.json` (the whole pipeline, loadable by the
`tokenizers` library) and `tokenizer_config.json` (special tokens and, from older
`transformers`, the Jinja chat template; newer ones save it as `chat_template.jinja`, with named
extras under `additional_chat_templates/`, and those files win). `transformers.AutoTokenizer` is a large dependency that the serving path only needs
for three things: encode, decode and render the chat template. `Tokenizer` does those three
with `tokenizers` + `jinja2` and mirrors what `transformers` 5.x does at each step, so the ids
we feed the model are the ids the model was trained and evaluated with:

- loading: named special tokens missing from the vocab are added as special tokens, and an
  explicit `add_bos_token` / `add_eos_token` in the config rebuilds the post-processor
  (`TokenizersBackend.update_post_processor`);
- decoding: `clean_up_tokenization_spaces` is honoured, except for BPE models where
  `transformers` 5 ignores it because it corrupts BPE output;
- chat templates: an `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`,
  `loopcontrols`, a non-escaping `tojson`, `raise_exception`, `strftime_now`, and the special
  tokens (`bos_token`, `eos_token`, ...) as template variables; the rendered text is then
  encoded with `add_special_tokens=False`, exactly like `apply_chat_template(tokenize=True)`.

The repr never contains text: only the vocab size and special token ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors

from wire import ChatPrompt, Prompt, detect_tool_call_format

__all__ = ["Tokenizer", "CHAT_ROLES"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers >= 4.50 saves a model's chat template beside the config: the default one in
# CHAT_TEMPLATE_FILE, named others as CHAT_TEMPLATE_DIR/<name>.jinja. When present they take
# priority over tokenizer_config.json's "chat_template" (as in transformers' from_pretrained).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
SENTENCEPIECE_FILE = "tokenizer.model"
# Reserved template variables: what a caller's template kwargs may not replace.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# Names a message's reasoning may come under; templates read "reasoning_content" or "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# The named special tokens of a `transformers` tokenizer, in its order.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-style dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"tokenizer_config.json: a special token must be a string or a dict with a string 'content', "
        f"got {type(value).__name__}"
    )


def _special_tokens_from_config(config: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """(named special tokens, extra special tokens) the way transformers 5 reads tokenizer_config.json.

    Named: the standard seven, then the dict form of `extra_special_tokens`, then any other
    `*_token` key with a token value (e.g. Gemma's `image_token`), then
    `model_specific_special_tokens`. Extras: the list form of `extra_special_tokens`
    (`additional_special_tokens` in configs written by transformers 4).
    """
    named: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        content = _token_content(config.get(name))
        if content is not None:
            named[name] = content
    extras_value = config.get("extra_special_tokens")
    if extras_value is None:
        extras_value = config.get("additional_special_tokens")
    extras: list[str] = []
    if isinstance(extras_value, Mapping):
        for name, value in extras_value.items():
            named[str(name)] = _token_content(value)
    elif isinstance(extras_value, list):
        extras = [_token_content(value) for value in extras_value]
    elif extras_value is not None:
        raise ValueError(
            "tokenizer_config.json: extra_special_tokens must be a list of tokens or a dict of named tokens"
        )
    for key, value in config.items():
        if key.endswith("_token") and key not in named and (
            isinstance(value, str) or (isinstance(value, Mapping) and isinstance(value.get("content"), str))
        ):
            named[key] = _token_content(value)
    explicit = config.get("model_specific_special_tokens")
    if isinstance(explicit, Mapping):
        named.update({str(k): _token_content(v) for k, v in explicit.items()})
    named = {k: v for k, v in named.items() if v is not None}
    return named, [t for t in extras if t is not None]


def _chat_templates_from_config(value: Any) -> dict[str, str]:
    """tokenizer_config.json's `chat_template`: a string (the default), or a list of {name, template}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        templates: dict[str, str] = {}
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError("tokenizer_config.json: each entry of chat_template must be "
                                 "{\"name\": string, \"template\": string}")
            templates[entry["name"]] = entry["template"]
        return templates
    raise ValueError(
        f"tokenizer_config.json: chat_template must be a string or a list of {{name, template}} dicts, "
        f"got {type(value).__name__}"
    )


def _chat_templates_from_files(model_dir: Path) -> dict[str, str]:
    """chat_template.jinja (the default) and additional_chat_templates/<name>.jinja, if present.
    Only regular files directly in the model dir are read (no symlinks out of it)."""
    templates: dict[str, str] = {}
    default = model_dir / CHAT_TEMPLATE_FILE
    if default.is_file() and not default.is_symlink():
        templates["default"] = default.read_text(encoding="utf-8")
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir() and not extra_dir.is_symlink():
        for path in sorted(extra_dir.glob("*.jinja")):
            if path.is_file() and not path.is_symlink():
                templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must contain a JSON object, got {type(data).__name__}")
    return data


def _eos_ids_from(value: Any, source: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise ValueError(f"{source}: eos_token_id must be an int or a list of ints, got a bool")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (as in transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict(...)` for templates without handing them the `dict` type itself (as in transformers).
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces that refuse underscore-prefixed attributes, so templates cannot reach CPython internals.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks the shape of a chat; messages never appear in the error text (they may be private)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"messages[{index}]['role'] must be one of {sorted(CHAT_ROLES)}")
        content = message.get("content")
        # An assistant turn that only calls tools has no content (OpenAI sends null).
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"messages[{index}]['content'] must be a string")
    # Like transformers: drop None-valued keys, hand the template copies (not the caller's dicts),
    # and expose reasoning under every name templates read it by.
    chat = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


class Tokenizer:
    """Encode, decode and chat-template rendering for one model dir; see the module docstring."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | Mapping[str, str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        # Named special tokens are template variables (bos_token, ...); extras only count as special.
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._extra_special_tokens = tuple(extra_special_tokens)
        # Special tokens missing from the vocab are added as special tokens, as transformers does.
        wanted = list(dict.fromkeys([*self._special_tokens.values(), *self._extra_special_tokens]))
        missing = [t for t in wanted if backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in missing])
        # Named chat templates ("default", and e.g. "tool_use"), compiled once.
        templates = {"default": chat_template} if isinstance(chat_template, str) else dict(chat_template or {})
        self._chat_templates = {name: _compile_chat_template(source) for name, source in templates.items()}
        self._chat_template_sources = dict(templates)
        # BPE output is corrupted by the WordPiece-era clean-up, so transformers 5 skips it for BPE.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

        eos_ids: list[int] = []
        eos_token = self._special_tokens.get("eos_token")
        if eos_token is not None:
            eos_ids.append(self._require_id(eos_token))
        eos_ids.extend(extra_eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(eos_ids))  # deduplicated, first occurrence order
        bos_token = self._special_tokens.get("bos_token")
        self._bos_token_id = self._require_id(bos_token) if bos_token is not None else None

        # transformers' order: named special tokens, then extras, each token once.
        self._all_special_ids = tuple(self._require_id(t) for t in wanted)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Loads tokenizer.json, tokenizer_config.json and (if present) generation_config.json."""
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            if (model_dir / SENTENCEPIECE_FILE).is_file():
                raise FileNotFoundError(
                    f"{model_dir} has only {SENTENCEPIECE_FILE} (a SentencePiece model) and no {TOKENIZER_FILE}; "
                    f"Thaw reads the fast-tokenizer file: write it once with transformers, "
                    f"AutoTokenizer.from_pretrained(dir).save_pretrained(dir), and deploy again"
                )
            raise FileNotFoundError(
                f"{tokenizer_path} not found: a model dir needs a Hugging Face fast-tokenizer file ({TOKENIZER_FILE})"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))

        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) if config_path.is_file() else {}
        special_tokens, extra_special_tokens = _special_tokens_from_config(config)

        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            backend.post_processor = _bos_eos_post_processor(
                backend,
                special_tokens,
                add_bos=bool(config.get("add_bos_token", False)),
                add_eos=bool(config.get("add_eos_token", False)),
            )

        extra_eos: list[int] = []
        generation_path = model_dir / GENERATION_CONFIG_FILE
        if generation_path.is_file():
            extra_eos = _eos_ids_from(_read_json(generation_path).get("eos_token_id"), str(generation_path))

        return cls(
            backend,
            special_tokens=special_tokens,
            extra_special_tokens=extra_special_tokens,
            chat_template=(_chat_templates_from_files(model_dir)
                           or _chat_templates_from_config(config.get("chat_template"))),
            extra_eos_token_ids=extra_eos,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # ---- ids ---------------------------------------------------------------------------------

    def _require_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (what `len(hf_tokenizer)` returns)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """tokenizer_config's eos_token, then generation_config's eos_token_id(s), deduplicated."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids of the named special tokens, then the extra ones (transformers' `all_special_ids`).

        `decode(skip_special_tokens=True)` skips more than these: every added token marked special.
        """
        return self._all_special_ids

    @property
    def has_chat_template(self) -> bool:
        return "default" in self._chat_templates

    @property
    def chat_template_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._chat_templates))

    def tool_call_format(self) -> str | None:
        """The format the chat templates teach the model to call tools in (`wire.TOOL_CALL_FORMATS`;
        the tool-use template first), or None."""
        for name in ("tool_use", "default", *sorted(self._chat_template_sources)):
            source = self._chat_template_sources.get(name)
            if source is not None and (found := detect_tool_call_format(source)) is not None:
                return found
        return None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def to_json_str(self) -> str:
        """The whole pipeline as tokenizer.json text, the special tokens added at load included:
        what libraries that read that format take (the structured-output grammar engine)."""
        return self._backend.to_str()

    # ---- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            text = _clean_up_tokenization(text)
        return text

    # ---- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Renders a chat to the prompt text the model expects.

        With `tools` the template named "tool_use" is used where the model has one (transformers'
        rule), else the default; `tools` is passed to the template either way. `template_kwargs`
        become extra template variables (e.g. Qwen3's ``enable_thinking``); they may not replace
        messages, tools, documents or add_generation_prompt."""
        name = "tool_use" if tools and "tool_use" in self._chat_templates else "default"
        template = self._chat_templates.get(name)
        if template is None:
            raise ValueError(
                f"this model has no chat template (neither {CHAT_TEMPLATE_FILE} nor tokenizer_config.json's "
                "'chat_template' gives a default one); send a plain completion prompt instead"
            )
        extra = dict(template_kwargs or {})
        clashing = sorted(_RESERVED_TEMPLATE_VARIABLES & extra.keys())
        if clashing:
            raise ValueError(f"chat template arguments may not set {', '.join(clashing)}: these come from the request")
        chat = _validate_messages(messages)
        try:
            return template.render(**{**self._special_tokens, **extra}, messages=chat,
                                   tools=list(tools) if tools else None, documents=None,
                                   add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            # e.g. raise_exception("Conversation roles must alternate user/assistant"): the user's to fix
            raise ValueError(f"the model's chat template refused these messages: {exc}") from exc

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A request's prompt as token ids: text is encoded with the special tokens the model adds,
        a chat (messages alone, or a `ChatPrompt` with tools and template arguments) is rendered by
        the chat template, token ids pass through unchecked (the engine knows the vocab).
        `ValueError` says what is wrong with the prompt, never what it contains."""
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, ChatPrompt):
            return self.encode_chat(list(prompt.messages), tools=prompt.tools or None,
                                    template_kwargs=prompt.template_kwargs)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):
            return self.encode_chat([dict(m) for m in prompt])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("prompt must be a string, a list of token ids, or a chat (a list of messages)")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Ids of the rendered chat; the template writes its own BOS, so none is added here."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools=tools, template_kwargs=template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self._bos_token_id}, "
            f"eos_token_ids={self._eos_token_ids}, has_chat_template={self.has_chat_template})"
        )


def _bos_eos_post_processor(
    backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str], *, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """The post-processor transformers builds when the config sets add_bos_token / add_eos_token."""
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    pairs = []
    for token, wanted in ((bos, add_bos), (eos, add_eos)):
        if wanted:
            token_id = backend.token_to_id(token)
            if token_id is None:
                backend.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)])
                token_id = backend.token_to_id(token)
            pairs.append((token, token_id))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=pairs)


def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization, for WordPiece-style models.
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )
