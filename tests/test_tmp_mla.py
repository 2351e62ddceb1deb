import pytest
from conftest import LAYOUTS, REFERENCE, layout_run, losses, BF16

ROWS = [("fsdp2_mla", []), ("tp_mla", []), ("ep2_mla", []), ("pp_mla", []), ("cp_mla", []), ("fsdp2_mla", BF16), ("tp_mla", BF16)]


@pytest.mark.parametrize("row", range(len(ROWS)))
def test_row(train_once, row):
    name, precision = ROWS[row]
    ref = layout_run(train_once, REFERENCE[name], precision)[0]
    got = layout_run(train_once, name, precision)[0]
    d = max(abs(a - b) for a, b in zip(losses(got), losses(ref)))
    dm = max((abs(a.get("mtp_loss", 0) - b.get("mtp_loss", 0)) for a, b in zip(got, ref)), default=0)
    print(f"\nROW {name} {precision} {d:.2e} mtp {dm:.2e} {REFERENCE[name]} {[round(r.get('mtp_loss', 0), 4) for r in got]}")
