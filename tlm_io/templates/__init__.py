"""The Python files an export writes beside the weights, kept as modules of this package so that they are imported,
linted and tested like the rest of it; tlm_io.export copies or renders them into checkpoint folders.

* ``modeling_tapered.py``: the ``hf`` view's remote code, written out for Llama. :func:`render_tapered` gives it for
  another stock family: the spots where the file names its family (:data:`TAPERED_FIELDS`) take that family's names,
  and a family whose MLP is built otherwise brings its own ``_layer_mlp`` (:data:`LAYER_MLP_FILES`).
* ``configuration_decilm.py`` and ``modeling_decilm.py``: the ``deci`` view's remote code, copied as they are
  (:data:`DECI_FILES`).
"""

from __future__ import annotations

import ast
from importlib import resources

TAPERED_FILE = "modeling_tapered.py"
DECI_FILES = ("configuration_decilm.py", "modeling_decilm.py")
# model type -> the template whose ``_layer_mlp`` replaces the Llama one (an MLP not built as ``MLP(layer_config)``)
LAYER_MLP_FILES = {"gpt2": "tapered_gpt2_mlp.py"}

# where modeling_tapered.py names its family, in the order they are replaced: (the Llama text, what stands there for
# any family); the longer class names go before "Llama" alone
TAPERED_FIELDS = (
    ("transformers.models.llama.modeling_llama", "transformers.models.{module}.modeling_{module}"),
    ("`llama` config", "`{model_type}` config"),
    ("intermediate_size`", "{width_key}`"),
    ("LlamaForCausalLM", "{causal_lm}"),
    ("LlamaModel", "{base}"),
    ("LlamaMLP", "{mlp}"),
    ("self.layers)", "self.{layers})"),
    ("self.model =", "self.{prefix} ="),
    ("Llama", "{arch}"),
)


def template_bytes(name: str) -> bytes:
    """The bytes of the template file ``name`` (one of this package's modules)."""
    return resources.files(__name__).joinpath(name).read_bytes()


def _text(name: str) -> str:
    return template_bytes(name).decode("utf-8")


def layer_mlp_source(name: str) -> str:
    """The lines of the ``_layer_mlp`` function in template ``name``."""
    text = _text(name)
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "_layer_mlp")
    return "".join(text.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno])


def tapered_format(model_type: str = "llama") -> str:
    """modeling_tapered.py as a ``str.format`` template with the fields of :data:`TAPERED_FIELDS` and the
    ``_layer_mlp`` of ``model_type``."""
    text = _text(TAPERED_FILE)
    if model_type in LAYER_MLP_FILES:
        text = text.replace(layer_mlp_source(TAPERED_FILE), layer_mlp_source(LAYER_MLP_FILES[model_type]))
    text = text.replace("{", "{{").replace("}", "}}")
    for llama, field in TAPERED_FIELDS:
        text = text.replace(llama, field)
    return text


def render_tapered(model_type: str, **fields: str) -> str:
    """modeling_tapered.py for ``model_type``: ``fields`` (arch, width_key, module, base, causal_lm, mlp, layers,
    prefix) put where the file has Llama's."""
    return tapered_format(model_type).format(model_type=model_type, **fields)


__all__ = ["DECI_FILES", "LAYER_MLP_FILES", "TAPERED_FIELDS", "TAPERED_FILE", "layer_mlp_source", "render_tapered",
           "tapered_format", "template_bytes"]
