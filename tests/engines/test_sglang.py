"""The SGLang adapter: it follows SGLang's documented interfaces and says it is unverified."""


def test_sglang_adapter_says_it_is_unverified():
    from restartkit.engines.sglang import SGLangAdapter
    from restartkit.policy import parse_policy
    p = parse_policy({"service": {"name": "s", "engine": "sglang", "model": "org/m", "device": "cuda"},
                      "sleep": {"enabled": True, "level": 1}})
    a = SGLangAdapter()
    argv = a.launch(p).argv
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--enable-memory-saver" in argv
    assert "--enable-weights-cpu-backup" in argv  # level 1 keeps the weights in host memory
    assert any("NOT run against a running SGLang" in n for n in a.plan_notes(p))
    assert a.feature_problems(p)["sleep"] is None and "not verified" in a.feature_problems(p)["ipc"]
    assert not a.can_confirm_sleep and a.sleep_needs_reload
