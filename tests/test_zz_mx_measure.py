import pytest
from conftest import BF16, layout_run, losses, val_losses, REFERENCE

@pytest.mark.parametrize("name, prec", [("single_mx", []), ("fsdp2_mx", []), ("tp_mx", []), ("pp_mx", []), ("single_moe_mx", BF16), ("ep2_moe_mx", BF16), ("ep2_fsdp2_moe_mx", []), ("single_moe_mx", [])])
def test_probe(train_once, name, prec):
    _, probe = layout_run(train_once, name, prec)
    rows = sorted((r["rank"], r["phase"], r["kind"], r["op"], r["dtypes"], r["count"]) for r in probe if r["kind"] in ("matmul", "quantize") and r["rank"] < 2)
    print("\nPROBE", name, prec, *rows, sep="\n  ")
