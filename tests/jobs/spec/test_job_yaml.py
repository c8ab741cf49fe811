"""The job file as YAML: files that are not job files (syntax errors with their line, not a
mapping, missing or unreadable) and --set overrides (every kind, located errors, YAML aliases)."""

from __future__ import annotations

import pytest

from salabatch.errors import JobSpecError
from salabatch.jobs.spec.load import load_job
from tests.jobs.spec.test_spec import MINIMAL, error_of, write

# ---- files that are not job files --------------------------------------------------------------


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    job = write(tmp_path, "name: x\nmodel: builtin:random\n  questions: [\n")
    with pytest.raises(JobSpecError) as info:
        load_job(job)
    assert str(info.value).startswith(f"{job}: invalid YAML at line 3, column 12:")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "expected a mapping (name:, model:, …) at the top, got a list"),
        ("just text\n", "expected a mapping (name:, model:, …) at the top, got 'just text'"),
        ("", "job file is empty"),
        ("# only a comment\n", "job file is empty"),
        ("!!python/object:os.system {}\n", "invalid YAML at line 1, column 1: could not determine"),
    ],
)
def test_not_a_job_mapping(tmp_path, text, message):
    job = write(tmp_path, text)
    with pytest.raises(JobSpecError) as info:
        load_job(job)
    assert str(info.value).startswith(f"{job}: {message}")


@pytest.mark.parametrize("char", ["\x01", "\x00", "\x7f", "\ufffe"])
def test_a_control_character_is_a_job_file_error_with_its_line(tmp_path, char):
    # The loader refuses these as it is made, before it reads a line.
    job = write(tmp_path, f'name: x\nquestions: ["a{char}b"]\n')
    with pytest.raises(JobSpecError) as info:
        load_job(job)
    assert info.value.exit_code == 2
    assert str(info.value).startswith(
        f"{job}: invalid YAML at line 2, column 15: character U+{ord(char):04X} is not allowed"
    )


def test_a_lone_surrogate_is_a_job_file_error_with_its_line(tmp_path):
    """YAML's double quotes read "\\ud800" as a lone surrogate, which no tokenizer and no
    Parquet file takes: refused before anything runs, as a typo is."""
    job = write(tmp_path, MINIMAL.replace("Summarize.", '"Who \\uD800 pays?"'))
    assert error_of(job) == (
        "questions[0].text: not text UTF-8 can hold (lone surrogate U+D800 at character 4) (line 4)"
    )


def test_missing_and_unreadable_job_files(tmp_path):
    with pytest.raises(JobSpecError, match="job file not found"):
        load_job(tmp_path / "nope.yaml")
    with pytest.raises(JobSpecError, match="is a folder"):
        load_job(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(JobSpecError, match="not UTF-8 text: byte 0xe9 at offset 9"):
        load_job(tmp_path / "latin1.yaml")


# ---- --set overrides ---------------------------------------------------------------------------


def test_overrides_of_every_kind(tmp_path):
    job = write(tmp_path, MINIMAL.replace("[{text: Summarize.}]", "[{text: a}, {text: b}]"))
    spec = load_job(
        job,
        [
            "engine.batch_size=4",
            "generation.think=true",
            "generation.temperature=0.7",
            "name=renamed",
            "system=Answer briefly: no lists #1",
            "questions.0.text=first?",
            "questions[1].id='007'",
            "cache.snapshot_every=0",
            "documents=[{path: other, glob: '*.md'}]",
        ],
    )
    assert spec.engine.batch_size == 4 and spec.generation.think is True
    assert spec.generation.temperature == 0.7
    assert spec.name == "renamed" and spec.output.path == tmp_path / "results" / "renamed.parquet"
    assert spec.system == "Answer briefly: no lists #1"
    assert [(q.id, q.text) for q in spec.questions] == [("q1", "first?"), ("007", "b")]
    assert spec.cache.snapshot_every == 0
    assert spec.documents[0].path == tmp_path / "other" and spec.documents[0].glob == "*.md"


def test_numbers_read_as_yaml_1_2_writes_them_in_the_file_and_in_overrides(tmp_path):
    # YAML 1.1 (PyYAML's default) reads 1e-3 as text and 010 as octal 8, silently
    text = MINIMAL + "generation: {temperature: 1e-3, seed: 0123}\nengine: {batch_size: 0x10}\n"
    spec = load_job(write(tmp_path, text))
    assert spec.generation.temperature == 0.001 and spec.generation.seed == 123
    assert spec.engine.batch_size == 16
    spec = load_job(
        write(tmp_path, MINIMAL),
        ["generation.temperature=5e-1", "generation.seed=010", "engine.prefill_chunk=0o100"],
    )
    assert spec.generation.temperature == 0.5 and spec.generation.seed == 10
    # a negative seed, as a request line's body and `generate --seed` take (it was refused)
    assert load_job(write(tmp_path, MINIMAL), ["generation.seed=-4"]).generation.seed == -4
    assert spec.engine.prefill_chunk == 64
    # neither sexagesimal nor underscores make numbers: text, refused where a number belongs
    assert "generation.seed" in error_of(write(tmp_path, MINIMAL + "generation: {seed: '1:30'}\n"))
    assert "generation.seed" in error_of(write(tmp_path, MINIMAL + "generation: {seed: 1:30}\n"))


def test_override_errors_are_located(tmp_path):
    job = write(tmp_path, MINIMAL)
    assert error_of(job, ("engine.batch_size=four",)) == (
        "engine.batch_size: expected an integer, got 'four' (from the command line)"
    )
    assert error_of(job, ("engine.batchsize=4",)).startswith(
        "engine.batchsize: unknown field, did you mean 'batch_size'?"
    )


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("engine.batch_size", "expected key=value"),
        ("=4", "expected a dotted key"),
        ("engine..batch_size=4", "expected a dotted key"),
        ("questions[x].text=a", "expected a dotted key"),
        ("name.first=a", "name is 'mini', not a mapping or a list"),
        ("questions.text=a", "questions is a list: give an item number, e.g. questions[0]"),
        ("questions[3].text=a", "questions has 1 items (numbered from 0)"),
        ("documents=[{path: a", "invalid YAML value"),
    ],
)
def test_malformed_overrides_name_the_override(tmp_path, override, reason):
    error = error_of(write(tmp_path, MINIMAL), (override,))
    assert error.startswith(f"--set {override!r}: {reason}")


def test_overrides_do_not_leak_through_yaml_aliases(tmp_path):
    job = write(
        tmp_path,
        """\
        name: alias
        model: builtin:random
        documents: [{path: d}]
        questions:
          - &base {id: a, text: same}
          - *base
        """,
    )
    spec = load_job(job, ["questions[1].id=b"])
    assert [q.id for q in spec.questions] == ["a", "b"]


def test_merge_keys_with_overrides_are_accepted(tmp_path):
    # Defect 5: PyYAML merges `<<` into the node tree as it constructs the data, so a check
    # of that tree afterwards saw the merged `id` beside the item's own and refused valid YAML.
    job = write(
        tmp_path,
        """\
        name: merge
        model: builtin:random
        documents: [{path: d}]
        questions:
          - &q {id: q1, text: "hi", max_tokens: 8}
          - {<<: *q, id: q2, text: "yo"}
          - <<: *q
            id: q3
        """,
    )
    spec = load_job(job)
    assert [(q.id, q.text, q.max_tokens) for q in spec.questions] == [
        ("q1", "hi", 8),
        ("q2", "yo", 8),
        ("q3", "hi", 8),
    ]
    # a key given twice in the item itself is still a mistake, located at its line
    twice = write(tmp_path, MINIMAL + "generation: {<<: {seed: 1}, seed: 2, seed: 3}\n")
    assert error_of(twice).startswith("generation.seed: duplicate key (line 5; first at line 5)")
