#!/usr/bin/perl

# Many slots, against a real llama-server with -np 4: sessions keep their
# slot, a session in no slot takes the best free one, requests of
# different slots run at the same time, every request is pinned to the
# module's slot ("id_slot", last in the body, so a client's own never
# wins), and no request ever runs on another session's cache.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $t = LlamaTest->new(workers => 4);
$t->llama(np => 4, ctx => 4 * 8192);

$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=4 store=%%SLOTS%% save_idle=1s;',
    upstream => 'keepalive 8;',
    location => q{
        llama_session_wait_timeout 120s;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Slot $llama_session_slot always;
    },
    extra => 'location /api/ { llama_session_api llama; }'));

my $system = join ' ', map { "Policy $_ applies to every answer." } 1 .. 30;

my %conv;

sub body_of {
    my ($sid, %o) = @_;
    $conv{$sid} //= [ { role => 'system', content => $system },
                      { role => 'user', content => join ' ', map {
                            "Session $sid remembers item $_." } 1 .. 60 } ];
    return { messages => $conv{$sid}, max_tokens => $o{max} // 2,
             temperature => 0, %{ $o{extra} // {} } };
}

sub turn {
    my ($sid, %o) = @_;
    my $r = $t->post('/v1/chat/completions', body_of($sid, %o),
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @{ $conv{$sid} },
        { role => 'assistant', content => $r->{json}{choices}[0]{message}{content} },
        { role => 'user', content => "Next question for $sid?" };
    return { prompt => $r->{json}{usage}{prompt_tokens},
             cached => $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
             action => $r->{headers}{'x-s-action'},
             slot => $r->{headers}{'x-s-slot'} };
}

# 12 sessions from 6 concurrent clients, 3 turns each
my @sessions = map { "s$_" } 1 .. 12;
my (@bad, %prev, %actions);
for my $round (1 .. 3) {
    for my $group (0 .. 1) {
        my @mine = @sessions[$group * 6 .. $group * 6 + 5];
        my @h = map { [ $_, $t->async_post('/v1/chat/completions',
                                           body_of($_),
                                           headers => { 'X-Session-Id' => $_ }) ] }
                @mine;
        for my $x (@h) {
            my ($sid, $h) = @$x;
            my $r = $t->async_wait($h, 300);
            if ($r->{status} != 200) {
                push @bad, "$sid: $r->{status}";
                next;
            }
            my $u = $r->{json}{usage};
            my $action = $r->{headers}{'x-s-action'};
            $actions{$action}++;
            my $cached = $u->{prompt_tokens_details}{cached_tokens};
            if ($prev{$sid}) {
                push @bad, "$sid $action: $cached cached of its previous "
                           . "$prev{$sid}"
                    if $cached < $prev{$sid} - 4;
            } elsif ($cached > $u->{prompt_tokens} / 2) {
                push @bad, "${sid}'s first turn: $cached of $u->{prompt_tokens} "
                           . 'cached (another session\'s?)';
            }
            $prev{$sid} = $u->{prompt_tokens};
            push @{ $conv{$sid} },
                { role => 'assistant',
                  content => $r->{json}{choices}[0]{message}{content} },
                { role => 'user', content => "Round $round for $sid?" };
        }
    }
}
ok(!$t->log_lines(qr/saving session "base-\w+" from slot \d+ failed/),
   'one slot at a time saves the shared system prompt\'s base');
is_deeply(\@bad, [], '12 sessions, 6 clients at a time: every returning '
          . 'turn finds its own whole history, no first turn another\'s')
    or diag join "\n", @bad;
ok($actions{restore}, "sessions were restored ($actions{restore})");

# a hot session keeps its slot while others rotate through the rest
my $hot = turn('hot');
my @hot_slots;
for my $i (1 .. 6) {
    turn("cold$i");
    my $h = turn('hot');
    push @hot_slots, $h->{slot};
    is($h->{action}, 'hit', "the hot session is a hit after cold$i");
}
is(scalar(grep { $_ eq $hot->{slot} } @hot_slots), 6,
   "and stays in slot $hot->{slot}");

# a client's own id_slot never wins
my $mine = turn('pinned');
my $other = ($mine->{slot} + 1) % 4;
my $r = turn('pinned', extra => { id_slot => $other });
is($r->{slot}, $mine->{slot}, 'a request that sends another id_slot');
cmp_ok($r->{cached}, '>=', $mine->{prompt} - 4,
       "runs on its own slot all the same ($r->{cached} cached of "
       . "$mine->{prompt})");
my $log = $t->read_file('llama.log');
my @by_id = $log =~ /selected slot by id/g;
cmp_ok(scalar @by_id, '>', 0, 'llama-server selected slots by id');

# four sessions on four slots run at once
for my $sid (map { "par$_" } 1 .. 4) { turn($sid) }
my @h = map { $t->async_post('/v1/chat/completions', body_of($_, max => 48),
                             headers => { 'X-Session-Id' => $_ }) }
        map { "par$_" } 1 .. 4;
my @res = map { $t->async_wait($_, 300) } @h;
is(scalar(grep { $_->{status} == 200 } @res), 4, 'four requests at once');
my $last_start = (sort { $b <=> $a } map { $_->{start} } @res)[0];
my $first_end = (sort { $a <=> $b } map { $_->{end} } @res)[0];
cmp_ok($last_start, '<', $first_end,
       sprintf('they overlap: the last began %.2f s before the first ended',
               $first_end - $last_start));
my %slots_used = map { $_->{headers}{'x-s-slot'} => 1 } @res;
is(scalar keys %slots_used, 4, 'on four slots');

# the API shows every slot; idle saves reach every slot
ok($t->wait_for(sub {
       my $c = $t->get('/api/sessions/current')->{json};
       @{ $c->{slots} } == 4
       && !grep { $_->{changed_since_save} } @{ $c->{slots} }
   }, 15), 'idle saves saved every slot');

# every inference endpoint is pinned: a client's id_slot never wins
my $words = join ' ', map { "word$_" } 1 .. 300;
my %endpoints = (
    '/completion' => sub { { prompt => "$_[0] $words $_[1]", n_predict => 2,
                             id_slot => $_[2] } },
    '/v1/completions' => sub { { prompt => "$_[0] $words $_[1]",
                                 max_tokens => 2, id_slot => $_[2] } },
    '/v1/responses' => sub { { input => "$_[0] $words $_[1]",
                               max_output_tokens => 2, id_slot => $_[2] } },
);
sub cached_of {
    my ($j) = @_;
    return $j->{timings}{cache_n}
           // $j->{usage}{input_tokens_details}{cached_tokens};
}
for my $ep (sort keys %endpoints) {
    my $sid = "ep$ep" =~ s{/}{_}gr;
    # the rig's random-weight model now and then writes what llama-server
    # cannot parse back (500 "does not match the expected ... format"):
    # that turn is asked again
    my $r1;
    for (1 .. 3) {
        $r1 = $t->post($ep, $endpoints{$ep}->($sid, 'one', 0),
                       headers => { 'X-Session-Id' => $sid });
        last unless $r1->{status} == 500
                    && ($r1->{content} // '') =~ /does not match/;
    }
    is($r1->{status}, 200, "$ep is served");
    my $s1 = $r1->{headers}{'x-s-slot'};
    # the other sessions take every other slot in between
    turn("between$_$sid") for 1 .. 3;
    # the same for the returning turn (its state is still in the slot)
    my ($r2, $tries);
    for (1 .. 3) {
        $tries++;
        $r2 = $t->post($ep, $endpoints{$ep}->($sid, 'two', ($s1 + 1) % 4),
                       headers => { 'X-Session-Id' => $sid });
        last unless $r2->{status} == 500
                    && ($r2->{content} // '') =~ /does not match/;
    }
    is($r2->{status}, 200, "$ep again, with another id_slot from the client");
    if ($tries == 1) {
        cmp_ok(cached_of($r2->{json}) // 0, '>', 250,
               "$ep: its own state on its own slot ("
               . (cached_of($r2->{json}) // 'no') . ' cached)');
    } else {
        # a 500 leaves the slot unknown to the module (it cannot vouch for
        # what a failed request left): the turn asked again starts fresh
        is($r2->{headers}{'x-s-action'}, 'fresh',
           "$ep: after a 500 the slot is not vouched for: fresh");
    }
}

# llama-server restarts: each session's next turn comes from its file
my @four = map { "after$_" } 1 .. 4;
my %before = map { $_ => turn($_) } @four;
ok($t->wait_for(sub {
       !grep { $_->{changed_since_save} }
            @{ $t->get('/api/sessions/current')->{json}{slots} }
   }, 15), 'the four are saved');
$t->stop_llama;
$t->llama(np => 4, ctx => 4 * 8192, port => $t->{llama_port}{llama});
for my $sid (@four) {
    my $r = turn($sid);
    is($r->{action}, 'restore', "after the restart $sid is restored, not "
       . 'taken for a hit');
    cmp_ok($r->{cached}, '>=', $before{$sid}{prompt} - 4,
           "$sid finds its history ($r->{cached} of "
           . "$before{$sid}{prompt})");
}
ok($t->log_lines(qr/llama-server restarted \(slot \d shows task/),
   'the restart is logged');

# Anthropic's endpoint: translated and pinned (t/96-anthropic.t)
$r = $t->post('/v1/messages', { model => 'm', max_tokens => 4,
                                messages => [ { role => 'user',
                                                content => 'hi' } ] },
              headers => { 'X-Session-Id' => 'claude' });
is($r->{status}, 200, '/v1/messages with four slots: 200');
is($r->{json}{type}, 'message', 'an Anthropic message');

$t->stop;
done_testing;
