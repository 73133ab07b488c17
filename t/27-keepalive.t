#!/usr/bin/perl

# Review 3: the connection llama-server closes first.  llama-server's HTTP
# library closes a kept-alive connection after 5 s idle; nginx's upstream
# keepalive keeps one 60 s unless told otherwise, and a POST sent on it as
# it closes gets a 502 that nginx does not retry.  The fake backend plays
# the race at a smaller scale (--idle-close 1.5: a request on a connection
# idle that long is closed unanswered).  The fix is the configuration
# (keepalive_timeout below the backend's, in every example) and, for the
# module's own slot calls, one retry when a kept-alive connection closed
# before any byte came back.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep);

# random weights: byte tokens make invalid UTF-8, which llama-server's chat
# parser refuses; ban them
my @ban = map { [ $_, JSON::PP::false ] } 3 .. 258;

sub chat {
    my ($t, $id, $text) = @_;
    return $t->post('/v1/chat/completions',
                    { messages => [ { role => 'user',
                                      content => "This is ${id}'s conversation." },
                                    { role => 'assistant', content => 'Go on.' },
                                    { role => 'user', content => $text } ],
                      max_tokens => 8, logit_bias => \@ban, seed => 1 },
                    headers => { 'X-Session-Id' => $id });
}

# the site, its upstream kept alive (HTTP/1.1, no Connection header)
sub site_kept {
    my ($t, $upstream, $more) = @_;
    return $t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        upstream => $upstream,
        location => 'proxy_http_version 1.1;
                     proxy_set_header Connection "";' . ($more // ''),
        slots => 'proxy_http_version 1.1;
                  proxy_set_header Connection "";');
}

# 1. the race, with nginx's default keepalive_timeout: a 502

{
    my $t = LlamaTest->new(workers => 1);
    $t->fake(np => 1, idle_close => 1.5);
    $t->nginx(site_kept($t, 'keepalive 4; keepalive_timeout 60s;'));
    is(chat($t, 'ann', 'one')->{status}, 200, '60 s: a first turn');
    sleep 2;
    # a POST the module passes by, so that no slot call (a GET, which
    # nginx sends again itself) takes a fresh connection first
    my $r = $t->post('/tokenize', { content => 'one' });
    is($r->{status}, 502, '60 s: a POST 2 s later races the backend\'s close: 502');
    ok($t->log_lines(qr/upstream prematurely closed connection/),
       '60 s: nginx says the upstream closed first');
    $t->stop;
}

# 2. keepalive_timeout below the backend's: nginx closes first

{
    my $t = LlamaTest->new(workers => 1);
    $t->fake(np => 1, idle_close => 1.5);
    $t->nginx(site_kept($t, 'keepalive 4; keepalive_timeout 1s;'));
    is(chat($t, 'ann', 'one')->{status}, 200, '1 s: a first turn');
    for my $n (1 .. 3) {
        sleep 2;
        is(chat($t, $n % 2 ? 'bob' : 'ann', 'one')->{status}, 200,
           "1 s: a turn 2 s later ($n)");
    }
    is(scalar(grep { $_->{closed} } @{ $t->fake_calls }), 0,
       '1 s: no request met a closing connection');
    $t->stop;
}

# 3. the module's own slot call that meets a closing kept-alive connection
# is sent again, once

{
    my $t = LlamaTest->new(workers => 1);
    $t->fake(np => 1, script => { save => { close_reused => 1 } });
    $t->nginx(site_kept($t, 'keepalive 4; keepalive_timeout 60s;'));
    is(chat($t, 'ann', 'one')->{status}, 200, 'ann');
    is(chat($t, 'bob', 'one')->{status}, 200, 'bob takes the slot');
    ok($t->log_lines(qr/closed a kept-alive connection before it answered the slot call save, sent again/),
       'the save met a closed connection and was sent again');
    my @saves = grep { ($_->{query} // '') =~ /action=save/ } @{ $t->fake_calls };
    is(scalar @saves, 2, 'two saves reached the backend');
    is(scalar(() = glob("$t->{slots}/ann-*.bin")), 1, 'ann is saved');
    is(chat($t, 'ann', 'one')->{headers}{'x-s-action'} // 'restore', 'restore',
       'and comes back');
    $t->stop;
}

# 4. the real llama-server (it closes idle connections after 5 s): a
# conversation with 5 s pauses, two sessions taking turns (slot calls and
# inferences on pooled connections), through the harness's upstream
# (keepalive_timeout 4s, as every example)

{
    my $t = LlamaTest->new(workers => 2);
    $t->llama(np => 1);
    $t->nginx(site_kept($t, 'keepalive 4;'));
    my @statuses;
    for my $n (1 .. 4) {
        push @statuses, chat($t, $n % 2 ? 'ann' : 'bob', "turn $n")->{status};
        sleep 5 if $n < 4;
    }
    is("@statuses", '200 200 200 200',
       'real: every turn after a 5 s pause is served');
    ok(!$t->log_lines(qr/upstream prematurely closed connection/),
       'real: no request met a connection llama-server closed');
    $t->stop;
}

# 5. llama-server answers an error (its parse error on a model's output)
# and closes the connection it said it keeps, as the next request comes on
# it: that request gets nothing back.  As shipped (the examples'
# proxy_next_upstream error non_idempotent) nginx sends it again on a new
# connection; without that line it is a 502.  A reply that began to come
# and broke off is never sent again.  (A POST the module passes by, as in
# 1, so that no slot call takes the connection first.)

for my $retry (1, 0) {
    my $t = LlamaTest->new(workers => 1);
    $t->fake(np => 1,
             script => { completion => { match => 'boom',
                                         status => 500, close_after => 1 } });
    $t->nginx(site_kept($t, 'keepalive 4; keepalive_timeout 60s;',
                        $retry ? 'proxy_next_upstream error non_idempotent;'
                               : ''));
    my $what = $retry ? 'shipped' : 'without proxy_next_upstream';
    is(chat($t, 'ann', 'one')->{status}, 200, "$what: a first turn");
    is(chat($t, 'ann', 'boom')->{status}, 500,
       "$what: llama-server's error reaches the client");
    my $r = $t->post('/tokenize', { content => 'two' });
    my @two = grep { ($_->{body} // '') =~ /"two"/ } @{ $t->fake_calls };
    is(scalar(grep { $_->{closed} } @two), 1,
       "$what: the next request met the connection closing");
    if ($retry) {
        is($r->{status}, 200, "$what: and is answered");
        is(scalar(grep { !$_->{closed} } @two), 1,
           "$what: sent again once, on a new connection");
    } else {
        is($r->{status}, 502, "$what: and is a 502");
        is(scalar @two, 1, "$what: not sent again");
    }

    if ($retry) {
        $t->fake_script({ completion => { match => 'half', cut => 20 } });
        $r = chat($t, 'ann', 'half');
        ok($r->{status} != 200 || !$r->{json},
           "$what: a reply cut short stays cut ($r->{status})");
        my @half = grep { ($_->{body} // '') =~ /"half"/ } @{ $t->fake_calls };
        is(scalar @half, 1, "$what: and is not sent again");
        is(chat($t, 'ann', 'three')->{status}, 200, "$what: the next turn");
    }
    $t->stop;
}

done_testing;
