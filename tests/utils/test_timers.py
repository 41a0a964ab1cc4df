from areal.utils.timers import FrequencyControl


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_fires_every_n_steps():
    fc = FrequencyControl(freq_steps=3)
    assert [fc.check(s) for s in range(1, 8)] == [False, False, True, False, False, True, False]


def test_fires_every_n_epochs_on_the_epoch_boundary():
    fc = FrequencyControl(freq_epochs=2)
    # 2 steps per epoch: epoch ends at steps 2, 4, 6 -> fires at the end of epochs 2 (step 4)
    assert [fc.check(s, epoch_done=s % 2 == 0) for s in range(1, 7)] == [False] * 3 + [True] + [
        False
    ] * 2


def test_fires_after_n_seconds_and_restarts_the_timer():
    clock = FakeClock()
    fc = FrequencyControl(freq_secs=10, clock=clock)
    clock.t = 9.0
    assert not fc.check(1)
    clock.t = 10.0
    assert fc.check(2)
    clock.t = 19.0
    assert not fc.check(3)  # 9 s since the last firing


def test_disabled_timer_never_fires():
    fc = FrequencyControl()
    assert not any(fc.check(s, epoch_done=True) for s in range(1, 50))


def test_state_round_trip_keeps_epochs_and_elapsed_seconds():
    clock = FakeClock()
    fc = FrequencyControl(freq_epochs=2, freq_secs=10, clock=clock)
    fc.check(1, epoch_done=True)
    clock.t = 4.0
    state = fc.state_dict()
    clock2 = FakeClock()
    clock2.t = 1000.0
    fc2 = FrequencyControl(freq_epochs=2, freq_secs=10, clock=clock2)
    fc2.load_state_dict(state)
    clock2.t = 1005.0  # 4 + 5 = 9 s since the last firing: not yet
    assert not fc2.check(2)
    assert fc2.check(3, epoch_done=True)  # second epoch done


def test_the_last_step_fires_whatever_the_frequency_without_restarting_the_seconds_timer():
    clock = FakeClock()
    fc = FrequencyControl(freq_steps=4, freq_secs=10, clock=clock)
    fc.last_step = 6
    fired = []
    for step in range(1, 7):
        clock.t = float(step)
        fired.append(fc.check(step))
    assert fired == [False, False, False, True, False, True]
    # the step-4 firing (t=4) restarted the seconds timer; the last step's (t=6) did not
    assert fc.state_dict()["secs_since_fire"] == 2.0
