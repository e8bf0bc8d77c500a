"""`wire.HostedInstance`: a hosted instance is called like an actor -- a plain method goes to the
host's ``call``, a streaming one to its ``stream`` -- naming the instance; it pickles."""

from __future__ import annotations

import pickle

from wire import HostedInstance, is_hosted, is_slot_host


class Method:
    def __init__(self, log, name, options=None):
        self.log, self.name, self.opts = log, name, options or {}

    def options(self, **options):
        return Method(self.log, self.name, {**self.opts, **options})

    def remote(self, *args, **kwargs):
        self.log.append((self.name, self.opts, args, kwargs))
        return "ref"


class FakeHost:
    def __init__(self):
        self.log = []
        self.call, self.stream = Method(self.log, "call"), Method(self.log, "stream")

    def host_instance_ids(self):
        return []


def test_calls_name_the_instance_and_streams_go_to_the_hosts_stream():
    host = FakeHost()
    instance = HostedInstance(host, "m-1")
    assert instance.stats.remote() == "ref"
    instance.generate.options(num_returns="streaming").remote("r1", "hi", {"max_tokens": 2})
    instance.abort.options(name="x").remote("r1")
    assert host.log == [("call", {}, ("m-1", "stats"), {}),
                        ("stream", {"num_returns": "streaming"}, ("m-1", "generate", "r1", "hi", {"max_tokens": 2}), {}),
                        ("call", {"name": "x"}, ("m-1", "abort", "r1"), {})]


def test_it_pickles_and_tells_itself_from_a_host():
    copy = pickle.loads(pickle.dumps(HostedInstance("host-handle", "m-1")))
    assert (copy.host, copy.instance_id) == ("host-handle", "m-1")
    assert is_hosted(copy) and not is_slot_host(copy)
    assert is_slot_host(FakeHost()) and not is_slot_host(object()) and not is_hosted(FakeHost())
