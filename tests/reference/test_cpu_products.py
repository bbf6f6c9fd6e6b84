"""The CPU's float32 products (restartkit.reference.model.kernels.linear): whichever form a CPU maker's table gives a
row count, the product is x @ W.T; the form is a function of the row count and the maker alone, so an engine that
restarts on the same host computes its canary the same way."""
import pytest
import torch

from restartkit.reference.model import kernels

ROWS = [1, 2, 4, 5, 8, 9, 16, 33, 48, 49, 64, 130]


@pytest.mark.parametrize("maker", sorted(kernels.CPU_FORMS))
def test_every_form_of_every_makers_table_computes_the_product(monkeypatch, maker):
    table = kernels.CPU_FORMS[maker]
    bounds = [most for most, _ in table]
    assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), table  # ascending, the last open
    monkeypatch.setattr(kernels, "_cpu_forms", lambda: table)
    torch.manual_seed(0)
    weight = torch.randn(96, 80)
    forms = set()
    for rows in ROWS:
        x = torch.randn(rows, 80)
        forms.add(kernels.cpu_form(rows))
        got = kernels.linear(x, weight)
        assert got.shape == (rows, 96) and got.is_contiguous()
        torch.testing.assert_close(got, x.double().matmul(weight.double().t()).float(), rtol=1e-5, atol=1e-5)
    assert forms == {form for _, form in table}  # every form of the table was taken


def test_the_form_is_chosen_by_this_cpus_maker():
    maker = kernels.cpu_maker()
    table = kernels.CPU_FORMS.get(maker, kernels.CPU_FORMS[""])
    for rows in ROWS:
        assert kernels.cpu_form(rows) == next(f for most, f in table if most is None or rows <= most), (maker, rows)
