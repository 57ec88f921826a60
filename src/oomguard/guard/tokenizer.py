"""Exact prompt counts in-process: the model's own tokenizer and chat template.

vLLM counts a prompt by rendering the chat template (transformers' ``apply_chat_template``
semantics) and encoding the text with the model's tokenizer. This module does the same with
the ``tokenizers`` library and a sandboxed Jinja environment, so the guard needs no
``/tokenize`` round trip per request. Both libraries are imported only when a tokenizer is
loaded.

What vLLM 0.32 does, and what is reproduced here (source files under ``vllm/``):

- completions are encoded with special tokens (``add_special_tokens`` defaults to true,
  ``entrypoints/openai/completion/protocol.py``); chats without them, the template writes
  its own (``entrypoints/openai/chat_completion/protocol.py``);
- the template gets ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
  named special tokens and the request's ``chat_template_kwargs`` that the template uses
  (``renderers/hf.py`` ``resolve_chat_template_kwargs``); the Jinja environment trims blocks
  and adds ``tojson`` without HTML escaping, ``raise_exception`` and ``strftime_now``
  (transformers ``utils/chat_template_utils.py``);
- messages are normalised first (``renderers/chat_utils.py``): text parts joined by newlines
  unless the template loops over ``message.content`` (then a list of text parts), tool-call
  arguments parsed into objects, a tool message's text parts joined, ``developer`` turned into
  ``system`` for templates that do not know it;
- tools are passed as ``{"type", "function": {"name", "description", "parameters"}}`` with
  absent fields as null (the request model's dump);
- a text longer than ``max_model_len`` times the longest token in characters is refused
  without encoding (``renderers/params.py``): such a prompt counts as ``max_model_len + 1``.

A request this cannot render the same way (images or audio, a per-request template,
``continue_final_message``) returns None: the caller asks the backend's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomguard.guard.openai_body import GenerationRequest

log = logging.getLogger("oomguard.guard")

# Texts up to this many characters are encoded on the event loop (tens of microseconds);
# longer ones in a worker thread, at most LARGE_ENCODES at once: with the body limit
# (max_body_bytes) that bounds the memory the encodings take.
INLINE_CHARS = 32_768
LARGE_ENCODES = 2
_SPECIAL_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
# apply_chat_template's own parameters: accepted in chat_template_kwargs whatever the template
# reads (transformers ``PythonBackend.apply_chat_template``, as vLLM lists them).
_BASE_KWARGS = frozenset(
    {"conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"
TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal", "thinking")


class TokenizerUnavailable(Exception):
    """No usable tokenizer for a model on this machine (the message says why)."""


def find_model_dir(root: str) -> Path | None:
    """The local directory of ``root`` (a path, or a hub id in the local hub cache), holding a
    ``tokenizer.json``; None when there is none. Never downloads."""
    path = Path(root).expanduser()
    if (path / "tokenizer.json").is_file():
        return path
    if root.count("/") != 1 or path.is_absolute():
        return None
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / ("models--" + root.replace("/", "--"))
    ref = repo / "refs" / "main"
    try:
        revision = ref.read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / revision
    return snapshot if (snapshot / "tokenizer.json").is_file() else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named chat templates, as transformers loads them (``default`` first)."""
    templates: dict[str, str] = {}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            str(t["name"]): str(t["template"])
            for t in value
            if isinstance(t, dict) and "name" in t and "template" in t
        }
    return {}


def _compile(source: str) -> Any:
    """A template in transformers' sandboxed environment (trimmed blocks, its globals)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # ``{% generation %}`` marks assistant text for training masks; rendering keeps it.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, env.from_string(source)


def _fast_render(template: Any) -> Callable[..., str]:
    """``template.render`` without rebuilding the globals for every call (what ``render``
    spends most of its time on for a short chat): they are merged into the variables once."""
    constant = dict(template.globals)
    new_context, root = template.new_context, template.root_render_func

    def render(**variables: Any) -> str:
        return "".join(root(new_context({**constant, **variables}, shared=True)))

    return render


@dataclass
class ChatTemplate:
    """One compiled chat template and what vLLM reads from its source."""

    source: str
    render: Callable[..., str]
    variables: frozenset[str]
    content_as_parts: bool
    knows_developer: bool

    @classmethod
    def compile(cls, source: str) -> ChatTemplate:
        import jinja2.meta

        env, template = _compile(source)
        ast = env.parse(source)
        return cls(
            source=source,
            render=_fast_render(template),
            variables=frozenset(jinja2.meta.find_undeclared_variables(ast)),
            content_as_parts=loops_over_content(ast),
            knows_developer='"developer"' in source or "'developer'" in source,
        )


def _reads(node: Any, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of ``names`` (or ``name.key`` / ``name[key]``), possibly
    filtered, tested or sliced."""
    import jinja2.nodes as n

    if isinstance(node, (n.Filter, n.Test)):
        return node.node is not None and _reads(node.node, names, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, names, key)
    if key is None:
        return isinstance(node, n.Name) and node.name in names
    if isinstance(node, n.Getitem):
        inner, attr = node.node, node.arg.value if isinstance(node.arg, n.Const) else None
    elif isinstance(node, n.Getattr):
        inner, attr = node.node, node.attr
    else:
        return False
    return attr == key and isinstance(inner, n.Name) and inner.name in names


def loops_over_content(ast: Any) -> bool:
    """Whether the template iterates over a message's ``content`` (vLLM's "openai" content
    format: content passed as a list of parts), as ``renderers/hf.py`` detects it."""
    import jinja2.nodes as n

    lists = {"messages"}
    for _ in range(4):  # names assigned from ``messages`` (``set loop_messages = ...``)
        for a in ast.find_all(n.Assign):
            if isinstance(a.target, n.Name) and _reads(a.node, lists):
                lists.add(a.target.name)
    loops = list(ast.find_all(n.For))
    items = {f.target.name for f in loops if isinstance(f.target, n.Name) and _reads(f.iter, lists)}
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in ast.find_all(n.Macro):
        params = _macro_content_params(ast, macro, items)
        for f in macro.find_all(n.For):
            in_macros.add(id(f))
            if params:
                macro_params[id(f)] = params
    for f in loops:
        if _reads(f.iter, items, "content"):
            return True
        if isinstance(f.iter, n.Name):
            if f.iter.name in macro_params.get(id(f), ()):
                return True
            if id(f) not in in_macros and f.iter.name == "content":
                return True
    return False


def _macro_content_params(ast: Any, macro: Any, items: set[str]) -> set[str]:
    """Parameters of ``macro`` that some call passes a message's content to."""
    import jinja2.nodes as n

    names = [a.name for a in macro.args]
    out: set[str] = set()
    for call in ast.find_all(n.Call):
        if not (isinstance(call.node, n.Name) and call.node.name == macro.name):
            continue
        for i, arg in enumerate(call.args):
            if i < len(names) and _reads(arg, items, "content"):
                out.add(names[i])
        for kw in call.kwargs:
            if kw.key in names and _reads(kw.value, items, "content"):
                out.add(kw.key)
    return out


@dataclass
class ModelTokenizer:
    """A model's tokenizer and chat templates, loaded once from its directory."""

    path: Path
    encoder: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str]
    templates: dict[str, ChatTemplate] = field(default_factory=dict)
    max_chars_per_token: int = 1

    @classmethod
    def load(cls, path: Path) -> ModelTokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json`` and the chat templates."""
        try:
            from tokenizers import Tokenizer, processors
        except ImportError:
            raise TokenizerUnavailable("the tokenizers package is not installed") from None
        config_file = path / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            encoder = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise TokenizerUnavailable(f"cannot read the tokenizer in {path}: {exc}") from None
        special = {k: t for k in _SPECIAL_NAMES if (t := _token_text(config.get(k)))}
        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers rebuilds the post-processor from these two flags when the config
            # states either (``TokenizersBackend.update_post_processor``).
            encoder.post_processor = _bos_eos_processor(processors, encoder, special, config)
        vocab = encoder.get_vocab(with_added_tokens=True)
        templates = {}
        for name, source in _read_templates(path, config).items():
            try:
                templates[name] = ChatTemplate.compile(source)
            except Exception as exc:  # a template Jinja cannot parse: chats go to /tokenize
                log.warning("chat template %r of %s does not compile: %s", name, path, exc)
        return cls(path, encoder, special, templates, max(len(t) for t in vocab) if vocab else 1)

    # -- counting ------------------------------------------------------------------------
    def count_text(self, text: str, add_special_tokens: bool, max_model_len: int | None) -> int:
        """Tokens of ``text``; a text too long for ``max_model_len`` counts as one more."""
        if max_model_len is not None and len(text) > max_model_len * self.max_chars_per_token:
            return max_model_len + 1
        fast = getattr(self.encoder, "encode_batch_fast", None)  # tokenizers 0.20+: no offsets
        if fast is not None:
            return len(fast([text], add_special_tokens=add_special_tokens)[0])
        return len(self.encoder.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> str | None:
        """The chat as vLLM's template renders it, or None when it cannot be done here."""
        if body.get("chat_template") is not None or body.get("continue_final_message"):
            return None
        tools = _tool_dicts(body.get("tools"))
        template = self._template(tools is not None)
        if template is None:
            return None
        conversation = normalise_messages(messages, template)
        if conversation is None:
            return None
        kwargs = dict(body.get("chat_template_kwargs") or {})
        effort = body.get("reasoning_effort")
        if effort is not None:
            kwargs["reasoning_effort"] = effort
            kwargs.setdefault("enable_thinking", effort != "none")
        context = {
            **self.special_tokens,
            **{
                k: v for k, v in kwargs.items() if k in template.variables and k not in _BASE_KWARGS
            },
            "add_generation_prompt": body.get("add_generation_prompt", True) is not False,
            "documents": body.get("documents"),
            "messages": conversation,
            "tools": tools,
        }
        try:
            return template.render(**context)
        except Exception:  # noqa: BLE001 - the template refused the chat: /tokenize says why
            return None

    def _template(self, with_tools: bool) -> ChatTemplate | None:
        if with_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default")


def _bos_eos_processor(
    processors: Any, encoder: Any, special: dict[str, str], config: dict[str, Any]
) -> Any:
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    single = f"{bos}:0 " if add_bos else ""
    single += "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    tokens = [(t, encoder.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM's request model dumps them (unknown fields dropped, absent ones null)."""
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            return None
        fn = tool["function"]
        function: dict[str, Any] = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        defer = tool.get("defer_loading")
        for key in ("strict", "defer_loading"):
            value = fn.get(key, defer if key == "defer_loading" else None)
            if value is not None:
                function[key] = value
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": function}
        if defer is not None:
            entry["defer_loading"] = defer
        out.append(entry)
    return out


def normalise_messages(
    messages: list[dict[str, Any]], template: ChatTemplate
) -> list[dict[str, Any]] | None:
    """The conversation as vLLM hands it to the template; None for non-text content."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = _normalise_message(m, template.content_as_parts)
        if msg is None:
            return None
        out.append(msg)
    if not template.knows_developer and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out


def _texts(content: Any, role: str) -> list[Any] | None:
    """The text of each part of ``content``; None when a part is not text."""
    if content is None:
        return []
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    texts: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES:
            text = part.get("text", part.get(str(part.get("type"))))
            if text is None:
                continue
            if not isinstance(text, str):
                return None
            texts.append(text)
        else:
            return None
    if role == "system":
        texts = _without_billing_header(texts)
    return texts


def _without_billing_header(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        if t.startswith(_BILLING_HEADER):
            t = t.partition("\n")[2]
            if not t:
                continue
        out.append(t)
    return out


def _normalise_message(m: dict[str, Any], as_parts: bool) -> dict[str, Any] | None:
    role = m["role"]
    texts = _texts(m.get("content"), role)
    if texts is None:
        return None
    msg: dict[str, Any] = {"role": role}
    if as_parts and role != "tool":
        msg["content"] = [{"type": "text", "text": t} for t in texts]
    else:
        msg["content"] = "\n".join(texts)
    if role == "assistant":
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            if calls:
                msg["tool_calls"] = [_tool_call(c) for c in calls]
        elif calls is not None:
            return None
        if m.get("reasoning") is not None:
            msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
    elif role == "tool" and "tool_call_id" in m:
        msg["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            msg[key] = m[key]
    if role == "developer":
        msg["tools"] = m.get("tools")
    return msg


def _tool_call(call: Any) -> dict[str, Any]:
    """A tool call with its arguments parsed into an object (``{}`` when not one)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call  # type: ignore[no-any-return]
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    fn["arguments"] = args if isinstance(args, dict) else {}
    return {**call, "function": fn}


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``developer`` messages as one ``system`` message first (vLLM's conversion)."""
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        c = converted[i].get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] for p in c if isinstance(p, dict) and "text" in p)
        if c:
            texts.append(c)
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def count_request(
    tok: ModelTokenizer, req: GenerationRequest, max_model_len: int | None
) -> list[int] | None:
    """Prompt tokens of each input of ``req`` as vLLM counts them; None when some input
    cannot be counted here (the caller asks the backend)."""
    special = req.body.get("add_special_tokens")
    if not req.chat:
        add = special is not False
        return [
            len(p) if isinstance(p, list) else tok.count_text(p, add, max_model_len)
            for p in req.prompts
        ]
    body = req.body if req.kind in ("chat", "chat_batch") else {}
    counts = []
    for conversation in req.conversations:
        text = tok.render_chat(conversation, body)
        if text is None:
            return None
        counts.append(tok.count_text(text, special is True, max_model_len))
    return counts


def request_kind(req: GenerationRequest) -> str:
    """What a check against the backend's own count covers: the tokenizer alone
    (``completion``), the chat template, or the template's tools."""
    if not req.chat:
        return "completion"
    return "tools" if req.body.get("tools") and req.kind in ("chat", "chat_batch") else "chat"


def request_chars(req: GenerationRequest) -> int:
    """Characters of text in the request (which decides where it is encoded)."""
    if not req.chat:
        return sum(len(p) for p in req.prompts if isinstance(p, str))
    total = 0
    for conversation in req.conversations:
        for m in conversation:
            c = m.get("content")
            total += len(c) if isinstance(c, str) else len(json.dumps(c))
    return total


class LocalTokenizers:
    """Model tokenizers found on this machine, by the backend's model path (``root`` in
    ``/v1/models``), loaded once in a worker thread.

    Each kind of request (:func:`request_kind`) of a model is also counted by the backend's
    ``/tokenize`` for its first ``verify_samples`` requests: equal counts make the local count
    trusted; a difference (another tokenizer or template configured on the server) sends that
    kind to ``/tokenize`` from then on.
    """

    def __init__(self, verify_samples: int = 3) -> None:
        self.verify_samples = verify_samples
        self._loaded: dict[str, ModelTokenizer | None] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._agreed: dict[tuple[str, str], int] = {}
        self._differs: set[tuple[str, str]] = set()
        self.reasons: dict[str, str] = {}

    def get(self, root: str) -> ModelTokenizer | None:
        """The tokenizer of ``root`` when loaded; starts loading it on the first call."""
        if root in self._loaded:
            return self._loaded[root]
        if root not in self._loading:
            self._loading[root] = asyncio.ensure_future(self._load(root))
        return None

    async def _load(self, root: str) -> None:
        def load() -> ModelTokenizer | None:
            path = find_model_dir(root)
            if path is None:
                self.reasons[root] = "no tokenizer.json on this machine"
                return None
            return ModelTokenizer.load(path)

        try:
            tok = await asyncio.to_thread(load)
        except TokenizerUnavailable as exc:
            self.reasons[root] = str(exc)
            tok = None
        except Exception as exc:  # noqa: BLE001 - a broken model dir must not stop the guard
            self.reasons[root] = f"{type(exc).__name__}: {exc}"
            tok = None
        if tok is not None:
            log.info("prompt counts for %s: in-process, tokenizer from %s", root, tok.path)
        else:
            log.info("prompt counts for %s: backend /tokenize (%s)", root, self.reasons[root])
        self._loaded[root] = tok
        self._loading.pop(root, None)

    def usable(self, root: str, kind: str) -> bool:
        """False once the backend counted this kind differently."""
        return (root, kind) not in self._differs

    def needs_check(self, root: str, kind: str) -> bool:
        """Whether this kind still wants the backend's count beside the local one."""
        return self._agreed.get((root, kind), 0) < self.verify_samples

    def check(self, root: str, kind: str, local: list[int], remote: list[int]) -> None:
        """Compare the local counts with the backend's."""
        if local == remote:
            self._agreed[(root, kind)] = self._agreed.get((root, kind), 0) + 1
            return
        self._differs.add((root, kind))
        log.warning(
            "prompt counts for %s (%s requests) differ from the backend's (%s here, %s there): "
            "the server has another tokenizer or chat template; those requests are counted by "
            "its /tokenize from now on",
            root,
            kind,
            local,
            remote,
        )

    def status(self) -> dict[str, Any]:
        """For ``/status``: which models are counted here, which by the backend and why."""
        out: dict[str, Any] = {}
        for root, tok in self._loaded.items():
            kinds = {k for (r, k) in self._agreed if r == root} | {
                k for (r, k) in self._differs if r == root
            }
            out[root] = {
                "in_process": tok is not None,
                "path": None if tok is None else str(tok.path),
                "reason": self.reasons.get(root),
                "verified": sorted(
                    k for k in kinds if not self.needs_check(root, k) and self.usable(root, k)
                ),
                "differs": sorted(k for (r, k) in self._differs if r == root),
            }
        return out
