"""ModelBundle: stop ids, and chat templates rendered as transformers renders
them, read from an HF folder's chat_template.jinja or tokenizer_config.json."""

import json

import jinja2
import pytest

import spec_jax as sj
from spec_jax.io import checkpoint, hf, pretrained
from spec_jax.io.bundle import ModelBundle

# Uses what real templates use: a system message, raise_exception, loop
# controls, a namespace, tojson, trimmed blocks and the bos_token variable.
TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
  {% if message['role'] == 'system' %}
    {% set ns.system = message['content'] %}
    {% continue %}
  {% endif %}
  {% if message['role'] not in ('user', 'assistant') %}
    {{ raise_exception('unknown role ' + message['role']) }}
  {% endif %}
<|{{ message['role'] }}|>{{ ns.system ~ ' ' if loop.index == 2 }}{{ message['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""
CHAT = [{"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi <there> & \"you\""},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye."}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  draft, tokenizer = checkpoint.load_model(pretrained.ROOT / "draft")
  path = tmp_path_factory.mktemp("draft")
  hf.save_hf(path, draft, tokenizer)
  return path


def test_stop_ids_normalise_and_eos_is_the_first():
  assert ModelBundle(None, None, 5).stop_ids == (5,)
  assert ModelBundle(None, None, None).eos_id is None
  assert ModelBundle(None, None, [7, 3, 7]).stop_ids == (7, 3)
  assert ModelBundle(None, None, (7, 3)).eos_id == 7


def test_template_from_tokenizer_config_or_jinja_file(folder):
  bundle = sj.load_hf(folder)
  assert bundle.chat_template is None
  with pytest.raises(ValueError, match="no chat template"):
    bundle.apply_chat_template(CHAT)
  config = json.loads((folder / "tokenizer_config.json").read_text())
  (folder / "tokenizer_config.json").write_text(
      json.dumps(dict(config, chat_template="old {{ messages | length }}")))
  assert sj.load_hf(folder).apply_chat_template(CHAT) == "old 4"
  (folder / "chat_template.jinja").write_text(TEMPLATE)  # Newer; it wins.
  bundle = sj.load_hf(folder)
  text = bundle.apply_chat_template(CHAT)
  assert text.startswith("<|endoftext|>\n<|user|>Be terse. \"Hi <there>")
  assert text.endswith("<|user|>\"Bye.\"\n<|assistant|>")
  assert bundle.encode_chat(CHAT) == bundle.tokenizer.encode(
      text, add_special_tokens=False).ids
  with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
    bundle.apply_chat_template(CHAT + [{"role": "tool", "content": "x"}])


def test_rendering_matches_transformers(folder):
  transformers = pytest.importorskip("transformers")
  (folder / "chat_template.jinja").write_text(TEMPLATE)
  bundle = sj.load_hf(folder)
  theirs = transformers.AutoTokenizer.from_pretrained(folder)
  for prompt in (True, False):
    assert bundle.apply_chat_template(CHAT, prompt) == (
        theirs.apply_chat_template(CHAT, tokenize=False,
                                   add_generation_prompt=prompt))
