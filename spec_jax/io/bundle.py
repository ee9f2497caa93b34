"""A loaded model with what is needed to talk to it: tokenizer, stop tokens and
chat template.

`load_hf` and `load_gguf` both return a `ModelBundle`. Chat templates are the
model's own Jinja text, rendered the way transformers renders them (a
sandboxed environment, trim_blocks and lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`, the special tokens as variables), so a prompt built
here is the one the model was tuned on, byte for byte.
"""

import dataclasses
import datetime
import functools
import json

import tokenizers

from spec_jax.model import Model


@dataclasses.dataclass(frozen=True)
class ModelBundle:
  """A model, its tokenizer, its stop tokens and its chat template.

  stop_ids: the tokens that end a reply, the checkpoint's EOS first; chat
    models often have more than one (Gemma's <eos> and <end_of_turn>). An int
    or None is accepted and normalised to a tuple. A decode that stops at
    them: `DecodeConfig(eos_id=bundle.stop_ids or None, ...)`.
  chat_template: the Jinja chat template, or None for a base model without
    one.
  special_tokens: the template variables naming special tokens ("bos_token",
    "eos_token"...), as transformers passes them.
  """

  model: Model
  tokenizer: tokenizers.Tokenizer
  stop_ids: tuple[int, ...] = ()
  chat_template: str | None = None
  special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    stop_ids = self.stop_ids
    if stop_ids is None:
      stop_ids = ()
    elif isinstance(stop_ids, int):
      stop_ids = (stop_ids,)
    # Order kept, duplicates dropped: the first is the checkpoint's EOS.
    object.__setattr__(self, "stop_ids",
                       tuple(dict.fromkeys(int(i) for i in stop_ids)))

  @property
  def eos_id(self) -> int | None:
    """The first stop id (the checkpoint's EOS), or None if there is none."""
    return self.stop_ids[0] if self.stop_ids else None

  def apply_chat_template(self, messages: list[dict],
                          add_generation_prompt: bool = True) -> str:
    """The conversation as the model's template writes it.

    messages: [{"role": "system" | "user" | "assistant", "content": str}...].
    add_generation_prompt: end with the header of an assistant turn, so that
      the model's continuation is its reply.

    Raises:
      ValueError: the bundle has no chat template.
      jinja2.TemplateError: the template refuses the conversation (Gemma's
        raises on roles that do not alternate, for example).
    """
    if self.chat_template is None:
      raise ValueError(
          "this model has no chat template (a base model, or a GGUF or "
          "folder without one); format the prompt yourself, or load an "
          "instruction-tuned checkpoint.")
    return _compile(self.chat_template).render(
        messages=[dict(m) for m in messages], tools=None, documents=None,
        add_generation_prompt=add_generation_prompt, **self.special_tokens)

  def encode_chat(self, messages: list[dict],
                  add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `apply_chat_template(messages)`.

    The template writes the special tokens (BOS included, where the model
    wants one) itself, so the tokenizer adds none.
    """
    text = self.apply_chat_template(messages, add_generation_prompt)
    return self.tokenizer.encode(text, add_special_tokens=False).ids


@functools.lru_cache(maxsize=8)
def _compile(template: str):
  """The template compiled in transformers' environment (cached: templates
  run to hundreds of lines)."""
  # Imported here so that loading a model does not need jinja2.
  import jinja2  # pylint: disable=import-outside-toplevel
  import jinja2.ext  # pylint: disable=import-outside-toplevel
  import jinja2.sandbox  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None,
             sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)

  def strftime_now(format):  # pylint: disable=redefined-builtin
    return datetime.datetime.now().strftime(format)

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which some templates use to
    mark the assistant's tokens for training masks, renders its body."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [],
                                    body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[Generation, jinja2.ext.loopcontrols])
  environment.filters["tojson"] = tojson
  environment.globals["raise_exception"] = raise_exception
  environment.globals["strftime_now"] = strftime_now
  return environment.from_string(template)


def special_tokens(tokenizer: tokenizers.Tokenizer,
                   ids: dict[str, int | None]) -> dict[str, str]:
  """{"bos_token": "<s>"...} from {"bos_token": id...}, skipping missing
  ids."""
  tokens = {}
  for name, token_id in ids.items():
    token = tokenizer.id_to_token(token_id) if token_id is not None else None
    if token is not None:
      tokens[name] = token
  return tokens
