"""State files read back at a start (kvhold.protocol.state_files), one format at a time: the
request death counts, the pool generation, a drain's record, the hold record. What their writer
writes reads back the same; anything else is refused with a reason and the file set aside as
`<name>.bad`, never fatal. (Kept results: test_kept_results; durable journal records:
test_sidecar_durable_journal.)"""
import json

import pytest
from hypothesis import given, settings, strategies as st

from kvhold.protocol.state_files import StateFileError, read_generation, set_aside
from kvhold.sidecar.request_deaths import DeathCounts, RequestDeaths

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=14), inner,
                                                                                  max_size=4), max_leaves=16)


def test_set_aside_renames_the_file_beside_it(tmp_path, caplog):
    path = tmp_path / "x.json"
    path.write_text("damaged")
    assert set_aside(path, "not JSON", "the file") == tmp_path / "x.json.bad"
    assert not path.exists() and (tmp_path / "x.json.bad").read_text() == "damaged"
    assert "not JSON" in caplog.text and "x.json.bad" in caplog.text
    assert set_aside(path, "gone", "the file") is None            # nothing there: nothing to do


# ------------------------------------------------------------------ request_deaths.json
def test_death_counts_round_trip():
    counts = DeathCounts(suspects=((1 << 40 | 3, 1, 17),), failed_total=2, forgiven_total=9)
    assert DeathCounts.from_json(json.dumps(counts.to_doc())) == counts
    assert DeathCounts.from_json("{}") == DeathCounts()


@pytest.mark.parametrize("text", ["null", "[]", "[1, 2]", '"counts"', "7", '{"failed_total": 1e400}',
                                  '{"failed_total": -1}', '{"failed_total": true}', '{"forgiven_total": "3"}',
                                  '{"suspects": null}', '{"suspects": [[1, 1]]}', '{"suspects": [[0, 1, 5]]}',
                                  '{"suspects": [[18446744073709551616, 1, 5]]}', '{"suspects": [[1, 0, 5]]}',
                                  '{"suspects": [[1, 1, 5], [1, 1, 6]]}', '{"suspects": [[1, 1, 1e400]]}',
                                  '{"other": 1}', '{"failed_total": 1', "\xff", "[" * 100_000])
def test_damaged_death_counts_are_refused(text):
    with pytest.raises(StateFileError):
        DeathCounts.from_json(text)


@settings(max_examples=300, deadline=None)
@given(doc=_json)
def test_any_json_is_death_counts_or_a_state_file_error(doc):
    try:
        counts = DeathCounts.from_json(json.dumps(doc))
    except StateFileError:
        return
    assert DeathCounts.from_json(json.dumps(counts.to_doc())) == counts


@pytest.mark.parametrize("text", ["null", "[]", '{"failed_total": 1e400}', '{"suspects": [[1, 2, "x"]]}'])
def test_a_sidecar_over_a_damaged_store_counts_from_zero_and_sets_it_aside(tables, tmp_path, text):
    store = tmp_path / "request_deaths.json"
    store.write_text(text)
    deaths = RequestDeaths(tables, lambda *a: None, store=store)
    assert deaths.status() == {"suspects": 0, "failed_total": 0, "forgiven_total": 0}
    assert (tmp_path / "request_deaths.json.bad").read_text() == text and not store.exists()


def test_a_good_store_is_read_back(tables, tmp_path):
    store = tmp_path / "request_deaths.json"
    store.write_text(json.dumps(DeathCounts(failed_total=3, forgiven_total=4).to_doc()))
    assert RequestDeaths(tables, lambda *a: None, store=store).status()["failed_total"] == 3


# ------------------------------------------------------------------ generation
@pytest.mark.parametrize("text, value", [("7\n", 7), ("0", 0), ("16777215", 16777215)])
def test_a_generation_reads_back(tmp_path, text, value):
    (tmp_path / "generation").write_text(text)
    assert read_generation(tmp_path / "generation") == value


@pytest.mark.parametrize("text", ["1e400", "-5", "16777216", "seven", "", "9" * 5000, "\xff"])
def test_a_damaged_generation_counts_as_none_and_is_set_aside(tmp_path, text):
    (tmp_path / "generation").write_text(text)
    assert read_generation(tmp_path / "generation") == 0
    assert (tmp_path / "generation.bad").exists() and not (tmp_path / "generation").exists()
    assert read_generation(tmp_path / "absent") == 0


# ------------------------------------------------------------------ last-drain.json
def test_a_drain_record_reads_back_and_a_damaged_one_is_set_aside(tmp_path):
    from kvhold.sidecar.durable_journal import DurableJournal
    from kvhold.sidecar.pool_restart import check_drain_record

    durable = DurableJournal(tmp_path / "journal")
    record = {"generation": 2, "hold": False, "drain_start_ns": 5, "in_flight": 3}
    durable.write_json("last-drain.json", record)
    assert durable.read_json("last-drain.json", check_drain_record) == record
    for bad in ({"drain_start_ns": "soon"}, {"hold": 1}, {"in_flight": -1}, [1]):
        durable.write_json("last-drain.json", bad)
        assert durable.read_json("last-drain.json", check_drain_record) is None
        assert (durable.dir / "last-drain.json.bad").exists() and not (durable.dir / "last-drain.json").exists()
    assert durable.read_json("last-drain.json", check_drain_record) is None


# ------------------------------------------------------------------ the hold record
@pytest.mark.parametrize("text, back", [('{"generation": 3}', {"generation": 3}), ("null", {}), ("[]", {}),
                                        ('{"generation": "x"}', {}), ('{"generation": 1e400}', {}),
                                        ("{", {}), ("[" * 100_000, {})])
def test_a_hold_record_is_released_whatever_it_holds(tmp_path, text, back):
    from kvhold.protocol.naming import InstancePaths

    paths = InstancePaths.for_instance("held", tmp_path)
    paths.runtime_dir.mkdir(parents=True, exist_ok=True)
    paths.hold_file.write_text(text)
    assert paths.release_hold() == back and not paths.hold_file.exists()
    assert paths.release_hold() is None
