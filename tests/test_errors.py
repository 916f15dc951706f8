"""The one error root: every refusal of the library is a TLMError, keeps the built-in base its callers catch, is
importable where it always was, and the command line prints it as one ``error:`` line."""

import pytest

import tlm_io.errors as errors
from tlm_cli.common import report_failure

KINDS = {errors.ConversionError: ValueError, errors.RecipeError: ValueError, errors.TrainError: RuntimeError,
         errors.StateError: ValueError, errors.AnalysisError: ValueError}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_error_is_a_tlm_error_and_keeps_its_builtin_base(kind):
    err = kind("what is wrong; how to fix it")
    assert isinstance(err, errors.TLMError) and isinstance(err, KINDS[kind])
    with pytest.raises(KINDS[kind]):  # code that caught the built-in error still catches it
        raise err


def test_errors_are_importable_from_their_old_modules():
    from tlm_study.analyze import AnalysisError
    from tlm_train.recipe import RecipeError
    from tlm_train.state_io import StateError
    from tlm_train.trainer import TrainError

    assert (AnalysisError, RecipeError, StateError, TrainError) == (errors.AnalysisError, errors.RecipeError,
                                                                    errors.StateError, errors.TrainError)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_the_cli_prints_any_tlm_error_as_one_line(kind, capsys):
    with pytest.raises(SystemExit) as exit_:
        report_failure(kind("checkpoint-7 is incomplete\n  - manifest.json is missing"))
    assert exit_.value.code == 1
    assert capsys.readouterr().err == "error: checkpoint-7 is incomplete; manifest.json is missing\n"
