import pytest

from tests.rollout import tool_model


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """The tiny chat model taught to call the calculator (tests/rollout/tool_model.py), built once."""
    return tool_model.build(tmp_path_factory.mktemp("tool_model"))
