"""Files we did not write are data, never code: every transformers load passes ``trust_remote_code`` explicitly.

Left unset, transformers asks "Do you wish to run the custom code? [y/N]" on stdin when a tokenizer or config
carries an ``auto_map`` to Python files of the model folder; piped input (``echo y |``) answers it. Passing
``False`` refuses instead, and :func:`auto_tokenizer` turns that refusal into one line naming the flag that allows
the code (``--trust-remote-code``), for sources the user trusts.
"""

from __future__ import annotations

from .errors import ConversionError, one_line

FLAG = "--trust-remote-code"


def remote_code_refused(path, err: BaseException | None = None) -> ConversionError:
    return ConversionError(f"'{path}' ships its own Python code (an auto_map in its tokenizer or model config) that "
                           f"would have to run to load it; it is not run unless you pass {FLAG} (only for sources "
                           "you trust)")


def is_remote_code_refusal(err: BaseException) -> bool:
    return isinstance(err, ValueError) and "trust_remote_code" in one_line(err)


def auto_tokenizer(path, trust_remote_code: bool = False, **kwargs):
    """``AutoTokenizer.from_pretrained(path, **kwargs)`` that never prompts and never runs the folder's code unless
    ``trust_remote_code``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as err:
        if is_remote_code_refusal(err) and not trust_remote_code:
            raise remote_code_refused(path, err) from None
        raise


__all__ = ["FLAG", "auto_tokenizer", "remote_code_refused", "is_remote_code_refusal"]
