import pytest

from diloco.config import Config, load_config, parse_override
from diloco.errors import ConfigError


def test_defaults_are_valid():
    config = load_config()
    assert isinstance(config, Config)
    assert config.learners.count == 4
    assert config.speeds() == [1.0, 1.0, 0.5, 0.25]


def test_setting_count_alone_makes_learners_equal():
    """The heterogeneous default fits 4 learners only; another count means equal speeds, not an error."""
    assert load_config(None, ["learners.count=3"]).speeds() == [1.0, 1.0, 1.0]
    assert load_config(None, ["learners.speeds=[1, 0.5]"]).learners.count == 2


def test_toml_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "diloco"\nseed = 3\n[outer]\nH = 20\nlr = 0.5\n')
    config = load_config(path, ["outer.H=30", "strategy=streaming"])
    assert config.seed == 3
    assert config.outer.H == 30
    assert config.outer.lr == 0.5
    assert config.strategy == "streaming"


def test_override_values_are_toml_and_bare_words_are_strings():
    assert parse_override("learners.speeds=[1,1,0.5]") == ("learners.speeds", [1, 1, 0.5])
    assert parse_override("strategy=diloco") == ("strategy", "diloco")
    assert parse_override("outer.lr = 0.4") == ("outer.lr", 0.4)
    assert parse_override('data.source="my file.bin"') == ("data.source", "my file.bin")


def test_speeds_alone_set_the_learner_count():
    config = load_config(None, ["learners.speeds=[1,1,0.5]"])
    assert config.learners.count == 3
    assert config.speeds() == [1.0, 1.0, 0.5]


def test_integers_are_accepted_as_floats():
    assert load_config(None, ["outer.lr=1"]).outer.lr == 1.0


@pytest.mark.parametrize("override, fragment", [
    ("outer.nope=1", "unknown config key 'outer.nope'"),
    ("nope=1", "unknown config key 'nope'"),
    ("outer.H=ten", "'outer.H' must be an integer"),
    ("outer.H=2.5", "'outer.H' must be an integer"),
    ("outer.H=0", "'outer.H' must be positive"),
    ("outer.lr=-1", "'outer.lr' must be positive"),
    ("outer.momentum=1", "'outer.momentum' must be in [0, 1)"),
    ("outer.alpha=1.5", "'outer.alpha' must be in [0, 1]"),
    ("strategy=sgd", "'strategy' must be one of ddp, diloco, streaming"),
    ("learners.speeds=fast", "'learners.speeds' must be a list"),
    ("learners.speeds=[1,0]", "'learners.speeds[1]' must be positive"),
    ("learners.jitter=2", "'learners.jitter' must be in [0, 1)"),
    ("model.heads=3", "'model.heads' must divide model.width"),
    ("train.tokens=10", "'train.tokens' must cover at least one step"),
    ("outer.tau=50", "'outer.tau' must be in [0, outer.H)"),
    ("outer=3", "'outer' must be a section"),
    ("train.schedule=linear", "'train.schedule' must be one of cosine, constant"),
])
def test_bad_values_are_rejected_with_the_key_named(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message


def test_speeds_that_disagree_with_count():
    with pytest.raises(ConfigError, match="learners.speeds.*one entry per learner"):
        load_config(None, ["learners.count=4", "learners.speeds=[1,1]"])


def test_streaming_needs_fragments_at_most_H():
    with pytest.raises(ConfigError, match="outer.fragments"):
        load_config(None, ["strategy=streaming", "outer.H=4", "outer.fragments=5"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["outer.H"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("outer = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_examples_load():
    from pathlib import Path

    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))
    assert examples, "examples/ holds no configs"
    for path in examples:
        load_config(path)


def test_reproducible_is_refused_for_a_strategy_it_does_not_apply_to():
    with pytest.raises(ConfigError, match="'outer.reproducible'.*decoupled only") as err:
        load_config(None, ["strategy=diloco", "outer.reproducible=true"])
    assert "\n" not in str(err.value)
    assert load_config(None, ["strategy=decoupled", "outer.reproducible=true"]).outer.reproducible
