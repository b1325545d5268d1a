"""A request names its drafter (``speculative``: a drafter of the server's, or "off") through the OpenAI API: the
greedy text is the same whichever it names, and a drafter the server lacks is a 400 naming the ones it has; the
command line's flags choose the server's default drafter and whether it adapts."""

import argparse

import openai
import pytest
from helpers.server import MODEL_NAME, make_engine, model_folder, running_server

from serving.api.cli import _spec, add_commands
from serving.api.engine_spec import EngineSpec
from serving.spec_decode import SpecConfig, SuffixDrafter


@pytest.fixture(scope="module")
def spec_client(tmp_path_factory):
    # static draft lengths: an adaptive engine may (rightly) decide drafting does not pay on this CPU, and then no
    # verification step would run; the adaptive policy has deterministic tests of its own
    engine = make_engine(model_folder(tmp_path_factory.mktemp("models")),
                         speculative=SpecConfig.from_method("suffix", k=3))
    with running_server(engine) as (server, _):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0), engine


def test_each_drafter_a_request_names_gives_the_same_greedy_text(spec_client):
    client, engine = spec_client
    options = dict(model=MODEL_NAME, prompt="one two three one two three one two", max_tokens=16, temperature=0.0)
    texts = {name: client.completions.create(**options, extra_body={"ignore_eos": True, "speculative": name})
             .choices[0].text for name in (None, "suffix", "ngram", "off")}
    assert len(set(texts.values())) == 1, texts
    assert engine.spec_stats.num_steps > 0


def test_a_drafter_the_server_lacks_is_a_400_naming_its_drafters(spec_client):
    client, _ = spec_client
    with pytest.raises(openai.BadRequestError, match=r"speculative = 'eagle': expected None, 'off' or one of this "
                                                     r"engine's drafters \['ngram', 'suffix'\]"):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"speculative": "eagle"})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"speculative": ""})


def test_cli_flags_choose_the_server_default_drafter_and_whether_it_adapts():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    spec, _, _ = _spec(parser.parse_args(["serve", "--speculative", "suffix", "--static-speculation"]))
    assert (spec.speculative, spec.static_speculation) == ("suffix", True)
    assert EngineSpec.from_dict(spec.as_dict()) == spec  # what the core process receives
    with pytest.raises(ValueError, match="--static-speculation need --speculative"):
        EngineSpec(static_speculation=True)
    config = SpecConfig.from_method("suffix", adaptive=True)
    assert (config.name, config.k, config.adaptive, type(config.drafter)) == ("suffix", 8, True, SuffixDrafter)
    with pytest.raises(ValueError, match="speculative method 'suffix' takes no drafter checkpoint"):
        SpecConfig.from_method("suffix", "some/folder")
