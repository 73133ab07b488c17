#!/usr/bin/perl

# An idle save never makes its own session's client wait (idle.c,
# reprime.c, sched.c): a request of the session that comes while the idle
# save of its slot is under way, before the save's call to llama-server,
# takes the slot first (a hit); the save gives way, logged, and is made
# once the slot is idle again.  One that comes once the save's call is on
# its way takes the slot at once too (the slot is lent): llama-server runs
# the save first, the request's turn after it, and nginx does not wait for
# the save's reply; the turn is not in that file, so the slot stays
# changed and is saved again.  On the fake backend, whose GET /slots or
# save is made slow; what is checked is an order (the reply before the
# save's), not a time.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

# one slot (acquire()), then two (acquire_many()); ann's is the first
for my $np (1, 2) {
    subtest "$np slot(s)" => sub { run($np) };
}

done_testing;


sub run {
    my ($np) = @_;
    my $n = 0;
    my $t = LlamaTest->new(workers => 2);
    $t->fake(np => $np);
    $t->nginx($t->site(
        zone => "llama_session_zone zone=llama:1m slots=$np store=%%SLOTS%% "
              . 'save_idle=500ms;',
        location => 'add_header X-S-Action $llama_session_action always;',
        slots => 'proxy_read_timeout 30s;',
        extra => 'location /api/ { llama_session_api llama; }'));

    my @msgs = ({ role => 'user', content => 'Hello, I am Ann.' });

    my $turn = sub {
        my $r = $t->post('/v1/chat/completions', { messages => [ @msgs ] },
                         headers => { 'X-Session-Id' => 'ann' });
        is($r->{status}, 200, 'ann: 200');
        push @msgs, { role => 'assistant', content => 'ok' },
                    { role => 'user', content => 'And then?' };
        return $r;
    };

    my $gets = sub {
        scalar grep { $_->{method} eq 'GET' && $_->{path} =~ m{^/slots} }
               @{ $t->fake_calls } };

    $turn->();

    # the idle save's look at the slot takes 2 s, its save 3 s
    my $before = $gets->();
    $t->fake_script({ slots => { delay_ms => 2000 },
                      save => { delay_ms => 3000 } });
    ok($t->wait_for(sub { $gets->() > $before }, 10),
       'the idle save of ann begins (its GET /slots)');

    my $r = $turn->();
    is($r->{headers}{'x-s-action'}, 'hit', 'ann returns: a hit on her slot');

    my @calls = @{ $t->fake_calls };
    my ($chat) = grep { $calls[$_]{path} eq '/v1/chat/completions' } reverse 0 .. $#calls;
    my ($save) = grep { ($calls[$_]{query} // '') eq 'action=save' } 0 .. $#calls;
    ok(!defined $save || $save > $chat,
       'her request reached llama-server before any save of her slot');
    ok($t->wait_for(sub { $t->log_lines(qr/"ann-\w+" on slot $n of zone "llama" is not saved while idle: a request of the session came first/) }, 5),
       'the idle save gave way, logged');

    # the slot changed again: saved once idle, as always
    $t->fake_script({});
    my $saved = sub { scalar $t->log_lines(qr/idle save of "ann-\w+" from slot $n of zone "llama": \d+ tokens/) };
    ok($t->wait_for(sub { $saved->() == 1 }, 10), 'ann is saved once idle again');

    # now the save itself is slow: ann returns once its call went
    my $zone = sub { $t->get('/api/sessions/current')->{json} };
    $turn->();
    my $saves = sub {
        scalar grep { ($_->{query} // '') eq 'action=save' } @{ $t->fake_calls } };
    my $before_save = $saves->();
    $t->fake_script({ save => { delay_ms => 3000 } });
    ok($t->wait_for(sub { $saves->() > $before_save }, 10),
       'the idle save of ann sends its save');

    $r = $turn->();
    is($r->{headers}{'x-s-action'}, 'hit', 'ann returns during the save: a hit');
    is($saved->(), 1, 'her reply came before the save answered (she did not wait for it)');
    ok($t->log_lines(qr/"ann-\w+" takes slot $n of zone "llama" while its idle save is on its way: its turn goes behind the save in llama-server/),
       'logged: her turn goes behind the save');
    is($zone->()->{stats}{idle_lent}, 1, 'the API counts one request behind an idle save');

    ok($t->wait_for(sub { $saved->() == 2 }, 10), 'the save answers and is kept');
    ok($zone->()->{slots}[$n]{changed_since_save},
       'the slot is still changed after it: her turn is not in that file');
    $t->fake_script({});
    ok($t->wait_for(sub { $saved->() == 3 }, 10), 'and ann is saved again once idle');
    ok(!$t->log_lines(qr/\[(?:error|crit|alert)\]/), 'no error');

    $t->stop;
}
