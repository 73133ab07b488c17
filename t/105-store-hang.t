#!/usr/bin/perl

# A store that stops answering never blocks a worker (issue 43).  The
# store folder is mounted through a FUSE pass-through (t/hangfs.py) whose
# calls from nginx's workers (www-data) wait while a control file exists,
# as a hard NFS mount waits for its server; the backend (the fake, as
# root) reads and writes the folder beneath as before.  One worker, the
# store's calls in nginx's thread pool (the default): while a swap, an
# idle save, the API's list, a chat client's swap (its turn file read),
# the API's save (the same read), a failed save's look at the disk, a
# hit's check of a shared store, a warm start's base and a full pool's
# queue each wait on the store, a plain location of the same worker
# answers within a second; each waiting request is answered at its bound
# (store_timeout=2s); once the store answers, the
# calls left in their threads finish: the saves take their names, no
# temporary file stays, a session restores from the file committed late.
# Then the same with thread_pool=off: the plain location waits for the
# store, which is what the threads are for (the test can fail).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use HTTP::Tiny;
use LlamaTest;
use Test::More;
use Time::HiRes qw(time sleep);

plan skip_all => 'needs root, /dev/fuse and python3-fusepy'
    unless $> == 0 && -c '/dev/fuse'
           && system('/usr/bin/python3 -c "import fusepy" 2>/dev/null') == 0;

# valgrind runs one thread at a time and does not let go of the others
# while one waits in a stat() (a call it does not count as blocking): a
# worker's thread held by the store would hold the whole worker there
plan skip_all => 'a store held in a stat() holds a process under valgrind'
    if $ENV{TEST_NGINX_VALGRIND};

my $uid = (getpwnam($LlamaTest::USER))[2];

# a store mounted through hangfs, for the workers' user; returns
# (root folder, mount point, control file)
sub hung_store {
    my ($t) = @_;
    my $root = LlamaTest::slots_dir($t->dir . '/store-root');
    my $mnt = $t->dir . '/store';
    my $control = $t->dir . '/hang';
    mkdir $mnt or die;
    $t->spawn('hangfs', $t->dir . '/hangfs.log', '/usr/bin/python3',
              "$FindBin::Bin/hangfs.py", $root, $mnt, $control, $uid,
              $t->dir . '/hangfs.calls');
    my $end = time + 10;
    sleep 0.1 until system("mountpoint -q $mnt") == 0 || time > $end;
    die "hangfs did not mount\n" unless system("mountpoint -q $mnt") == 0;
    return ($root, $mnt, $control);
}

sub unmount {
    my ($t, $mnt, $control) = @_;
    unlink $control;
    system("fusermount -u -z $mnt 2>/dev/null || umount -l $mnt 2>/dev/null");
    $t->stop_proc('hangfs', 'TERM');
}

sub ask {
    my ($t, $id, $text) = @_;
    my $t0 = time;
    my $r = $t->post('/completion', { prompt => "$id: $text", n_predict => 2 },
                     headers => { 'X-Session-Id' => $id });
    $r->{secs} = time - $t0;
    return $r;
}

# GET /ping n times while something else waits: the slowest answer (a
# worker held by the store fails each after 3 s, and the test goes on)
sub pings {
    my ($t, $n) = @_;
    my ($worst, $ok) = (0, 0);
    my $http = HTTP::Tiny->new(timeout => 3);
    for (1 .. $n) {
        my $t0 = time;
        my $r = $http->get($t->url('/ping'));
        my $secs = time - $t0;
        $worst = $secs if $secs > $worst;
        $ok++ if $r->{status} == 200;
        sleep 0.2;
    }
    return ($ok, $worst);
}

sub nginx_with {
    my ($t, $mnt, $more, %o) = @_;
    $t->nginx($t->site(
        zone => "llama_session_zone zone=llama:1m store=$mnt "
                . "store_timeout=2s save_idle=1s $more;",
        server => $o{server} // '',
        location => 'add_header X-S-Action $llama_session_action always;',
        extra => 'location = /ping { return 200 "pong\n"; }
                  location /api/ { llama_session_api llama; }'),
              main => $o{main});
}

# one block: a worker, the fake backend on the store's root folder, nginx
# on its mount with the zone's PARAMS (%o: more directives of the "server"
# and "main" contexts); the mount and the servers go even when the block
# dies
sub with_hung_store {
    my ($params, $code, %o) = @_;
    my $t = LlamaTest->new(workers => 1);
    my ($root, $mnt, $control) = hung_store($t);
    eval {
        $t->fake(np => 1, slots => $root);
        nginx_with($t, $mnt, $params, %o);
        $code->($t, $root, $mnt, $control);
    };
    my $err = $@;
    unmount($t, $mnt, $control);
    $t->stop;
    die $err if $err;
}

# 1. threads (the default)
with_hung_store('', sub {
    my ($t, $root, $mnt, $control) = @_;

    is(ask($t, 'ann', 'first')->{status}, 200, 'ann: a first turn');

    # the store stops answering the workers
    open my $fh, '>', $control or die;
    close $fh;

    # a swap: bob's look at the store and ann's commit wait on it
    my $h = $t->async_post('/completion', { prompt => 'bob: first',
                                           n_predict => 2 },
                           headers => { 'X-Session-Id' => 'bob' });
    sleep 0.3;
    my ($ok, $worst) = pings($t, 5);
    is($ok, 5, 'while a swap waits on the store, /ping is answered');
    cmp_ok($worst, '<', 1, sprintf('within a second (%.3f s)', $worst));
    my $r = $t->async_wait($h, 30);
    is($r->{status}, 200, 'the swap is answered once its calls\' '
                          . 'bounds passed');
    ok($t->log_lines(qr/the store of zone "llama" did not answer within store_timeout=2000/),
       'the log says the store did not answer, and what went on without it');
    ok(!glob("$root/ann-*.bin"), 'ann\'s save is not committed while '
                                  . 'the store hangs');

    # the API's list: the index as it is, at its bound
    my $hl = $t->async_get('/api/sessions');
    sleep 0.3;
    ($ok, $worst) = pings($t, 4);
    is($ok, 4, 'while the API\'s list waits on the store, /ping is answered');
    cmp_ok($worst, '<', 1, sprintf('within a second (%.3f s)', $worst));
    my $l = $t->async_wait($hl, 20);
    is($l->{status}, 200, 'the list is answered, the index as it is');
    cmp_ok($l->{end} - $l->{start}, '<', 4,
           sprintf('at its bound at most (%.1f s: at once when a look '
                   . 'at the folder already waits)',
                   $l->{end} - $l->{start}));

    # bob's slot changed: its idle save (save_idle=1s) waits on the store
    ok($t->wait_for(sub {
           $t->log_lines(qr/the save is not committed yet/) >= 2 }, 15),
       'bob\'s idle save waited on the store too');
    ($ok, $worst) = pings($t, 3);
    is($ok, 3, 'and /ping is answered meanwhile');
    cmp_ok($worst, '<', 1, sprintf('within a second (%.3f s)', $worst));

    # the store answers again: what waited in its threads finishes
    unlink $control;
    ok($t->wait_for(sub { glob("$root/ann-*.bin")
                          && glob("$root/bob-*.bin") }, 10),
       'the store answers: ann\'s and bob\'s saves take their names');
    ok($t->wait_for(sub { !glob("$root/*.tmp") }, 10),
       'no temporary file stays');
    ok($t->log_lines(qr/the store of zone "llama" answered after \d+ ms, its request went on without it/),
       'the log says the calls ended late');

    $r = ask($t, 'ann', 'second');
    is($r->{status}, 200, 'ann returns');
    is($r->{headers}{'x-s-action'}, 'restore',
       'from the file committed late');
    cmp_ok($r->{json}{timings}{cache_n} // 0, '>', 0,
           'with its state (cache_n ' . ($r->{json}{timings}{cache_n} // 0)
           . ')');

    my $m = $t->get('/api/sessions');
    is($m->{status}, 200, 'the API lists again at once');
    ok($t->wait_for(sub {
           ($t->get('/metrics')->{content} // '')
               =~ /nginx_llama_session_store_timeouts_total\{zone="llama"\} [1-9]/ }, 5)
       || $t->log_lines(qr/did not answer within/),
       'counted');
});

# 3. a chat client's swap: its turn file (written in a thread after each
# reply) is read in a thread before the save's re-prime; the swap waits
# its bounds (look, turn, commit), /ping does not
with_hung_store('', sub {
    my ($t, $root, $mnt, $control) = @_;
    my $chat = sub {
        my ($id, $text) = @_;
        return $t->post('/v1/chat/completions',
                        { messages => [ { role => 'user',
                                          content => "$id: $text" } ] },
                        headers => { 'X-Session-Id' => $id });
    };
    is($chat->('cat', 'first')->{status}, 200, 'chat: cat\'s turn');
    ok($t->wait_for(sub { glob("$root/.turn.*") }, 5),
       'chat: its turn file is written');
    open my $fh, '>', $control or die;
    close $fh;
    my $h = $t->async_post('/v1/chat/completions',
                           { messages => [ { role => 'user',
                                             content => 'dog: first' } ] },
                           headers => { 'X-Session-Id' => 'dog' });
    sleep 0.3;
    my ($ok, $worst) = pings($t, 8);
    is($ok, 8, 'chat: while the swap waits on the store, /ping is answered');
    cmp_ok($worst, '<', 1, sprintf('chat: within a second (%.3f s)', $worst));
    is($t->async_wait($h, 30)->{status}, 200, 'chat: the swap is answered');
    ok($t->log_lines(qr/did not answer within store_timeout=2000 \(\d+ ms\): the session is saved without a re-prime/),
       'chat: the turn file\'s read had its bound');
    unlink $control;
    ok($t->wait_for(sub { glob("$root/cat-*.bin") }, 10),
       'chat: cat\'s save takes its name once the store answers');
    ok($t->wait_for(sub { !glob("$root/*.tmp") }, 10),
       'chat: no temporary file stays');
});

# 3b. the turn file is still being written when the next turn's swap
# needs it (a client that goes on as soon as its reply came): only the
# turn file's write is held; the re-prime's read waits for it, within its
# bound, and the save is re-primed once the write ends
with_hung_store('', sub {
    my ($t, $root, $mnt, $control) = @_;
    my $chat = sub {
        my ($id, $text) = @_;
        return $t->async_post('/v1/chat/completions',
                              { messages => [ { role => 'user',
                                                content => "$id: $text" } ] },
                              headers => { 'X-Session-Id' => $id });
    };
    open my $fh, '>', $control or die;
    print $fh "write /.turn.*.tmp\n";
    close $fh;
    is($t->async_wait($chat->('eve', 'first'), 10)->{status}, 200,
       'late turn file: eve\'s turn is answered while its file is held');
    my $h = $chat->('fay', 'first');
    sleep 0.8;
    ok(!glob("$root/.turn.*[0-9]"), 'late turn file: not written yet');
    unlink $control;
    is($t->async_wait($h, 10)->{status}, 200,
       'late turn file: fay\'s swap is answered');
    ok($t->log_lines(qr/re-primed "eve-\w+" on slot 0/),
       'late turn file: eve is re-primed before her save');
    ok(!$t->log_lines(qr/saved without a re-prime/),
       'late turn file: no save without one');
    ok($t->wait_for(sub { glob("$root/eve-*.bin") }, 5),
       'late turn file: eve\'s file is saved');
});

# 3c. a slot cleared while its turn file is still being written: the
# file's delete waits for the write, so no conversation's text stays
with_hung_store('', sub {
    my ($t, $root, $mnt, $control) = @_;
    open my $fh, '>', $control or die;
    print $fh "write /.turn.*.tmp\n";
    close $fh;
    my $r = $t->post('/v1/chat/completions',
                     { messages => [ { role => 'user',
                                       content => 'gus: first' } ] },
                     headers => { 'X-Session-Id' => 'gus' });
    is($r->{status}, 200, 'cleared: gus\'s turn is answered, its file held');
    like($t->post('/api/sessions/clear', {})->{content}, qr/"erased_tokens"/,
         'cleared: the API clears the slot');
    sleep 0.5;
    unlink $control;
    ok($t->wait_for(sub { !glob("$root/.turn.*") }, 5),
       'cleared: the turn file is gone once its write ended');
    sleep 0.5;
    ok(!glob("$root/.turn.*"), 'cleared: and stays gone');
});

# 3d. the API's save re-primes a slot first: its turn file is read in a
# thread, the request waits its bound, /ping does not
with_hung_store('', sub {
    my ($t, $root, $mnt, $control) = @_;
    is($t->post('/v1/chat/completions',
                { messages => [ { role => 'user', content => 'hal: first' } ] },
                headers => { 'X-Session-Id' => 'hal' })->{status}, 200,
       'api save: hal\'s turn');
    ok($t->wait_for(sub { glob("$root/.turn.*") }, 5),
       'api save: its turn file is written');
    open my $fh, '>', $control or die;
    print $fh "open /.turn.*\n";
    close $fh;
    my $h = $t->async_post('/api/sessions/save', {});
    sleep 0.3;
    my ($ok, $worst) = pings($t, 5);
    is($ok, 5, 'api save: while its read waits on the store, /ping is '
               . 'answered');
    cmp_ok($worst, '<', 1, sprintf('api save: within a second (%.3f s)',
                                   $worst));
    my $r = $t->async_wait($h, 30);
    is($r->{status}, 200, 'api save: answered at the bound');
    like($r->{content}, qr/"saved":\[\{[^]]*"key":"hal/,
         'api save: hal is saved');
    ok($t->log_lines(qr/did not answer within store_timeout=2000 \(\d+ ms\): the session is saved without a re-prime/),
       'api save: the turn file\'s read had its bound');
    unlink $control;
    ok(glob("$root/hal-*.bin"), 'api save: hal\'s file is there');
    ok($t->wait_for(sub { !glob("$root/.turn.*") }, 5),
       'api save: once the store answers, the read ends and the turn file '
       . 'goes');
});

# 3e. a save that llama-server fails (500, a full disk?): the look at the
# disk before it is sent again runs in a thread, within its bound
with_hung_store('', sub {
    my ($t, $root, $mnt, $control) = @_;
    is(ask($t, 'ian', 'first')->{status}, 200, 'failed save: ian');
    $t->fake_script({ save => { status => 500, times => 1 } });
    open my $fh, '>', $control or die;
    print $fh "statfs *\n";
    close $fh;
    my $h = $t->async_post('/completion', { prompt => 'jo: first',
                                           n_predict => 2 },
                           headers => { 'X-Session-Id' => 'jo' });
    # the swap's own look waits its bound first, then ian's save fails
    ok($t->wait_for(sub { grep { $_->{query} eq 'action=save' }
                               @{ $t->fake_calls } }, 10),
       'failed save: ian\'s save reached the backend');
    sleep 0.3;
    my ($ok, $worst) = pings($t, 8);
    is($ok, 8, 'failed save: while its look at the disk waits, /ping is '
               . 'answered');
    cmp_ok($worst, '<', 1, sprintf('failed save: within a second (%.3f s)',
                                   $worst));
    is($t->async_wait($h, 30)->{status}, 200,
       'failed save: jo\'s swap is answered');
    ok($t->log_lines(qr/did not answer within store_timeout=2000 \(\d+ ms\): the failed save is not sent again/),
       'failed save: the look had its bound, the save is not sent again');
    ok($t->log_lines(qr/saving session "ian-\w+" from slot 0 failed \(500/),
       'failed save: its failure is logged');
    unlink $control;
    ok($t->wait_for(sub { !glob("$root/*.tmp") }, 5),
       'failed save: no temporary file stays');
});

# 4. shared=on: a hit looks at the store for another owner's newer file
# first; with the store silent it stays a hit, at its bound
with_hung_store('shared=on', sub {
    my ($t, $root, $mnt, $control) = @_;
    is(ask($t, 'ann', 'first')->{status}, 200, 'shared: ann');
    open my $fh, '>', $control or die;
    close $fh;
    my $h = $t->async_post('/completion', { prompt => 'ann: first again',
                                           n_predict => 2 },
                           headers => { 'X-Session-Id' => 'ann' });
    sleep 0.3;
    my ($ok, $worst) = pings($t, 5);
    is($ok, 5, 'shared: while a hit\'s check waits on the store, /ping '
               . 'is answered');
    cmp_ok($worst, '<', 1, sprintf('shared: within a second (%.3f s)',
                                   $worst));
    my $r = $t->async_wait($h, 30);
    is($r->{status}, 200, 'shared: the hit is answered at its bound');
    is($r->{headers}{'x-s-action'}, 'hit', 'shared: still a hit');
    cmp_ok($r->{end} - $r->{start}, '<', 4,
           sprintf('shared: in %.1f s', $r->{end} - $r->{start}));
    unlink $control;
});

# 5. a warm start's base: the store stops answering while llama-server
# saves it; its commit waits in a thread, the new conversation goes on
# fresh at the bound, and the base takes its name once the store answers
with_hung_store('', sub {
    my ($t, $root, $mnt, $control) = @_;
    $t->fake_script({ save => { delay_ms => 1000, match => 'base-' } });
    my $h = $t->async_post('/v1/chat/completions',
                           { messages => [ { role => 'system', content =>
                                             'You answer in one line. ' x 4 },
                                           { role => 'user',
                                             content => 'wes: first' } ],
                             max_tokens => 2 },
                           headers => { 'X-Session-Id' => 'wes' });
    ok($t->wait_for(sub { grep { ($_->{query} // '') =~ /action=save/
                                 && ($_->{body} // '') =~ /base-/ }
                               @{ $t->fake_calls } }, 10),
       'warm: the base\'s save is on its way');
    open my $fh, '>', $control or die;
    close $fh;
    sleep 1;    # the save's reply: its commit waits on the store
    my ($ok, $worst) = pings($t, 5);
    is($ok, 5, 'warm: while the base\'s commit waits on the store, /ping '
               . 'is answered');
    cmp_ok($worst, '<', 1, sprintf('warm: within a second (%.3f s)',
                                   $worst));
    my $r = $t->async_wait($h, 30);
    is($r->{status}, 200, 'warm: the new conversation is answered at the '
                          . 'bound');
    ok($t->log_lines(qr/the save is not committed yet/),
       'warm: the log says the base is not committed yet');
    unlink $control;
    ok($t->wait_for(sub { glob("$root/base-*.bin") }, 10),
       'warm: the store answers, the base takes its name');
    ok($t->wait_for(sub { !glob("$root/*.tmp") }, 10),
       'warm: no temporary file stays');
}, server => 'llama_session_warm system min=16;');

# 6. the thread pool's queue full (one thread, a queue of one): the calls
# it cannot take wait in the worker, not run there, and are posted again
# once the store answers
with_hung_store('thread_pool=tiny', sub {
    my ($t, $root, $mnt, $control) = @_;
    is(ask($t, $_, 'first')->{status}, 200, "full queue: $_") for qw(ann bob cy);
    ok(glob("$root/ann-*.bin") && glob("$root/bob-*.bin"),
       'full queue: ann and bob saved');
    open my $fh, '>', $control or die;
    close $fh;
    my @h = map { $t->async_post("/api/sessions/$_", undef,
                                 method => 'DELETE') } qw(ann bob);
    sleep 0.5;
    my ($ok, $worst) = pings($t, 5);
    is($ok, 5, 'full queue: /ping is answered');
    cmp_ok($worst, '<', 1, sprintf('full queue: within a second (%.3f s)',
                                   $worst));
    is($t->async_wait($_, 30)->{status}, 200,
       'full queue: a DELETE is answered') for @h;
    ok($t->log_lines(qr/the thread pool of zone "llama"'s store has a full queue: its calls wait in the worker/),
       'full queue: the log says the calls wait in the worker');
    ok(glob("$root/ann-*.bin"), 'full queue: ann\'s file stays while the '
                                . 'store hangs');
    unlink $control;
    ok($t->wait_for(sub { !glob("$root/ann-*") && !glob("$root/bob-*") },
                    40),
       'full queue: the store answers, the deletions are made');
    # posted as the pool drains, not at the backlog's next timer (1, 2,
    # 4, 8... s apart)
    ok($t->wait_for(sub { $t->log_lines(qr/the calls that waited in the worker for a store's thread pool are posted/) }, 3),
       'full queue: the log says the calls were posted as the pool drained');
}, main => 'thread_pool tiny threads=1 max_queue=1;');

# 2. thread_pool=off: the calls in the event loop, a plain location of the
# worker waits for the store (what the threads are for)
with_hung_store('thread_pool=off', sub {
    my ($t, $root, $mnt, $control) = @_;
    is(ask($t, 'ann', 'first')->{status}, 200, 'off: ann');
    open my $fh, '>', $control or die;
    close $fh;
    my $h = $t->async_post('/completion', { prompt => 'bob: first',
                                           n_predict => 2 },
                           headers => { 'X-Session-Id' => 'bob' });
    sleep 0.5;
    my $p = $t->async_get('/ping');
    sleep 2;
    ok(!$t->async_done($p), 'off: /ping waits while the store hangs');
    unlink $control;
    is($t->async_wait($p, 20)->{status}, 200,
       'off: and is answered once it answers');
    is($t->async_wait($h, 20)->{status}, 200, 'off: so is the swap');
});

done_testing;
