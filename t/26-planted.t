#!/usr/bin/perl

# Review 3: files another user plants, or a backend names.  The store folder
# is llama-server's user's and /props names the model's path; a worker
# (www-data) must neither follow a link there into a file of its own user's
# (truncating it), nor open a FIFO with a blocking open (the worker stops
# for ever).  Every open goes through file.c: non-blocking, no link but for
# the model's path, a regular file only, created exclusively.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use POSIX qw(mkfifo);
use Test::More;

my $uid = (getpwnam($LlamaTest::USER))[2];

sub chat {
    my ($t, $id, $text) = @_;
    return $t->post('/v1/chat/completions',
                    { messages => [ { role => 'system', content => 'Be brief.' },
                                    { role => 'user', content => $text } ],
                      max_tokens => 8 },
                    headers => { 'X-Session-Id' => $id });
}

# 1. a link at the turn file's temporary name, to a file www-data may write

{
    my $t = LlamaTest->new(workers => 1, timeout => 15);
    $t->fake(np => 1);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;'));

    my $victim = $t->dir . '/victim.log';
    open my $fh, '>', $victim or die;
    print $fh "a log line of www-data's\n" x 1000;
    close $fh;
    chown $uid, -1, $victim;
    my $size = -s $victim;

    my $tmp = "$t->{slots}/.turn.llama.0.tmp";
    symlink $victim, $tmp or die "symlink: $!";

    is(chat($t, 'ann', 'Hello there, Ann speaking.')->{status}, 200,
       'link at the turn tmp: the turn is served');
    ok($t->wait_for(sub { -f "$t->{slots}/.turn.llama.0" }, 10),
       'the turn file is written');
    ok(!-l "$t->{slots}/.turn.llama.0", 'as a file of its own, not a link');
    is(-s $victim, $size, 'the file the link pointed at is whole');
    open $fh, '<', $victim or die;
    my $text = do { local $/; <$fh> };
    close $fh;
    unlike($text, qr/Ann speaking/, 'and holds no conversation');
    $t->stop;
}

# 2. a FIFO named by /props as the model's path

{
    my $t = LlamaTest->new(workers => 1, timeout => 15);
    my $fifo = $t->dir . '/model.gguf';
    mkfifo($fifo, 0666) or die "mkfifo: $!";
    $t->fake(np => 1, model => $fifo);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        extra => 'location /api/ { llama_session_api llama; }'));

    my $r = chat($t, 'ann', 'Hello');
    is($r->{status}, 200, 'a FIFO as the model: the worker is not blocked');
    is(chat($t, 'bob', 'Hello')->{status}, 200, 'and serves the next');
    ok($t->log_lines(qr/"\Q$fifo\E" is not a regular file/),
       'the log says the model path is not a regular file');
    is($t->get('/api/sessions/current')->{json}{backend}{memory}{kind},
       'unknown', 'its memory is unknown');
    $t->stop;
}

# 2b. a model path through a link (a hub cache) is still read

{
    my $t = LlamaTest->new(workers => 1, timeout => 15);
    my $real = $t->dir . '/blob';
    my $k = 'general.architecture';
    my $fh;
    open $fh, '>:raw', $real or die;
    my $w = 'gpt-oss.attention.sliding_window';
    print $fh 'GGUF', pack('V', 3), pack('Q<', 0), pack('Q<', 2),
        pack('Q<', length $k), $k, pack('V', 8), pack('Q<', 7), 'gpt-oss',
        pack('Q<', length $w), $w, pack('V', 4), pack('V', 128);
    close $fh;
    chmod 0644, $real;
    my $link = $t->dir . '/model.gguf';
    symlink $real, $link or die;
    $t->fake(np => 1, model => $link);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        extra => 'location /api/ { llama_session_api llama; }'));
    is(chat($t, 'ann', 'Hello')->{status}, 200, 'a model behind a link');
    is($t->get('/api/sessions/current')->{json}{backend}{memory}{kind},
       'swa', 'is read through it');
    $t->stop;
}

# 3. a FIFO planted as the turn file, read by the next swap's re-prime

{
    my $t = LlamaTest->new(workers => 1, timeout => 15);
    $t->fake(np => 1);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;'));

    is(chat($t, 'ann', 'Hello, this is Ann.')->{status}, 200, 'ann\'s turn');
    my $turn = "$t->{slots}/.turn.llama.0";
    ok($t->wait_for(sub { -f $turn }, 10), 'her turn file is there');
    unlink $turn or die;
    mkfifo($turn, 0666) or die "mkfifo: $!";

    my $r = chat($t, 'bob', 'Hello, this is Bob.');
    is($r->{status}, 200, 'a FIFO as the turn file: the swap goes on');
    is(chat($t, 'ann', 'Ann again.')->{status}, 200, 'and the worker serves on');
    ok($t->log_lines(qr/"\Q$turn\E" is not a regular file/),
       'the log says the turn file is not a regular file');
    my @saved = glob("$t->{slots}/ann-*.bin");
    is(scalar @saved, 1, 'ann was saved all the same (without a re-prime)');

    # a link as the turn file: not followed either
    my $secret = $t->dir . '/secret';
    open my $fh, '>', $secret or die;
    print $fh qq({"seq":1,"key":"x"}\n{});
    close $fh;
    chown $uid, -1, $secret;
    ok($t->wait_for(sub { -f $turn && !-p $turn }, 10), 'a new turn file');
    unlink $turn;
    symlink $secret, $turn or die;
    is(chat($t, 'bob', 'Bob again.')->{status}, 200, 'a link as the turn file');
    ok(-e $secret, 'what it points at is not read nor deleted');
    ok($t->log_lines(qr/\Q$turn\E" failed.*\(40: Too many levels of symbolic links\)/),
       'the log says it is a link');
    $t->stop;
}

# 5. a conversation's text goes with the API's clear and delete

{
    my $t = LlamaTest->new(workers => 2, timeout => 15);
    $t->fake(np => 2);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% slots=2;',
        extra => 'location /api/ { llama_session_api llama; }'));
    my $turn0 = "$t->{slots}/.turn.llama.0";
    my $turn1 = "$t->{slots}/.turn.llama.1";

    is(chat($t, 'ann', 'Secret of Ann.')->{status}, 200, 'ann\'s turn');
    is(chat($t, 'bob', 'Secret of Bob.')->{status}, 200, 'bob\'s turn');
    ok($t->wait_for(sub { -f $turn0 && -f $turn1 }, 10),
       'both slots have a turn file');

    my $r = $t->post('/api/sessions/clear', {});
    is($r->{status}, 200, 'clear');
    ok($t->wait_for(sub { !-e $turn0 && !-e $turn1 }, 5),
       'clear removes the turn files (in a thread of the store\'s)');

    # DELETE: ann saved, then in no slot (a clear), and a turn file that
    # still names her (one the slot's next use has not replaced yet)
    is(chat($t, 'ann', 'Secret of Ann.')->{status}, 200, 'ann again');
    ok($t->wait_for(sub { -f $turn0 || -f $turn1 }, 10), 'her turn file');
    my ($file) = grep { -f } $turn0, $turn1;
    is($t->post('/api/sessions/save', {})->{status}, 200, 'save');
    ok(!-e $file, 'the save\'s re-prime read and removed it');
    # the clear removes both slots' turn files in the store's threads,
    # after its reply: files planted before it show when that is done
    for my $f ($turn0, $turn1) {
        open my $fh, '>', $f or die;
        close $fh;
    }
    is($t->post('/api/sessions/clear', {})->{status}, 200, 'clear');
    ok($t->wait_for(sub { !-e $turn0 && !-e $turn1 }, 5),
       'its removals are done');
    my ($key) = map { m{/(ann-\w+)\.\w+\.bin$} } glob("$t->{slots}/ann-*.bin");
    open my $fh, '>', $file or die;
    print $fh qq({"seq":7,"key":"$key","message":{}}\n{"messages":"Secret of Ann."});
    close $fh;
    my $other = $file eq $turn0 ? $turn1 : $turn0;
    open $fh, '>', $other or die;
    print $fh qq({"seq":8,"key":"bob-x","message":{}}\n{});
    close $fh;

    $r = $t->request('DELETE', '/api/sessions/ann');
    is($r->{status}, 200, 'DELETE ann');
    ok($t->wait_for(sub { !-e $file }, 5),
       'DELETE removes the turn file that names her');
    ok(-e $other, 'and no other');
    $t->stop;
}

done_testing;
