import reader_spec.machine as machine
from reader_spec.budget.costs import cost_cache_path

EPYC_ZEN1 = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
)


def test_the_processor_is_named_by_family_and_model(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    other_block = EPYC_ZEN1.replace("processor\t: 0", "processor\t: 1").replace(": 23", ": 25")
    cpuinfo.write_text(EPYC_ZEN1 + "flags\t\t: fpu avx2\n\n" + other_block)  # one block per logical CPU
    fields = machine.cpuinfo_fields(cpuinfo)
    assert machine.cpu_id(fields) == "family 23 model 1"  # the first processor's
    assert fields["model name"] == "AMD EPYC" and fields["flags"] == "fpu avx2"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # no family on this architecture
    assert machine.cpu_id(machine.cpuinfo_fields(cpuinfo)) == ""
    assert machine.cpuinfo_fields(tmp_path / "missing") == {}


def test_costs_measured_on_one_processor_are_not_read_on_another(tmp_path, monkeypatch):
    """Two hosts named alike ("AMD EPYC", same core count) of different generations: a cache directory
    they share keeps a cost curve for each."""

    def costs_path(cpuinfo: str):
        path = tmp_path / "cpuinfo"
        path.write_text(cpuinfo)
        fields = machine.cpuinfo_fields(path)
        monkeypatch.setattr(machine, "_fields", lambda: fields)
        return cost_cache_path("model")

    zen1 = costs_path(EPYC_ZEN1 + "flags\t\t: fpu avx2\n")
    zen4 = costs_path(
        EPYC_ZEN1.replace(": 23", ": 25").replace(": 1\n", ": 17\n") + "flags\t\t: fpu avx512f\n"
    )
    assert zen1 != zen4
    assert zen1 == costs_path(EPYC_ZEN1 + "flags\t\t: fpu avx2\n")
