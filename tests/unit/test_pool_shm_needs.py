"""What a start asks of /dev/shm: the pool, and with a frontend in its own process room for the
old tables that it keeps mapped while a pool restart creates the next pool beside them."""

from kvhold.protocol.memory import HOST_ALIGN, round_up, shm_shortage
from kvhold.sidecar.regions import RESTART_RESERVE, shm_needs

MIB = 2**20
TABLES, SIZES = 84 * MIB, {"kv": 32 * MIB, "weights": 4 * MIB}


def total(needs):
    return sum(round_up(n, HOST_ALIGN) for n in needs.values())


def test_a_start_counts_the_old_tables_a_pool_restart_keeps_mapped():
    first_start = shm_needs(TABLES, SIZES, "host", restart_reserve=True)
    assert total(first_start) == 2 * TABLES + 36 * MIB          # what a pool restart needs later
    assert first_start[RESTART_RESERVE] == TABLES
    restart_image = shm_needs(TABLES, SIZES, "host", restart_reserve=False)
    assert total(restart_image) == TABLES + 36 * MIB            # the old tables are out of the free space
    assert shm_needs(TABLES, SIZES, "cuda", restart_reserve=True) == {"tables": TABLES, RESTART_RESERVE: TABLES}


def test_the_refusal_names_the_reserve():
    text = shm_shortage(shm_needs(TABLES, SIZES, "host", restart_reserve=True), 130 * MIB, 130 * MIB)
    assert "the pool needs 204.0 MiB" in text and f"{RESTART_RESERVE} 84.0 MiB" in text
